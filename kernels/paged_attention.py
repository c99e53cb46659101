"""Attention over the paged KV cache.

Cache layout, per layer: k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
A sequence's token at position p lives in block `block_tables[s, p // block_size]`
at offset `p % block_size`. The KV of every token a call attends to, the new ones
included, is already stored (store_kv runs first).

Attention variants, the same three keyword arguments in every attention path (the CPU
kernels, Triton, these references), each off by default (the default path's bits are
those of the plain causal attention below):

- `window` W > 0: a query at position p sees keys p - W + 1 .. p only (Mistral's, Gemma's
  and gpt-oss's sliding window, HF's `sliding_window`). No path reads a block that lies
  wholly before every query's window: the KV manager may have given it to another sequence.
- `softcap` c > 0: scores s = scale * q.k become c * tanh(s / c) before the mask (Gemma 2's
  `attn_logit_softcapping`).
- `sinks` float32 [num_heads]: a learned logit per query head, added to the softmax's
  denominator only, as one more key whose value is zero (gpt-oss's attention sinks).

A per-layer scale (Gemma's query_pre_attn_scalar) is the `scale` argument.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._lazy import triton_op

# The Triton versions live beside, in modules that import triton; see _lazy.py.
_TRITON = {
    "paged_decode_attention_triton": "paged_decode",
    "paged_prefill_attention_triton": "paged_prefill",
}


def __getattr__(name: str) -> Any:
    if name in _TRITON:
        return triton_op(__package__, _TRITON[name], name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    # -> [n, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    nb = (n + block_size - 1) // block_size
    return cache[table[:nb].long()].flatten(0, 1)[:n]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] context length, the current token included
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    if window > 0 or softcap > 0 or sinks is not None:
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return paged_prefill_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            starts,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = seq_lens.tolist()
    max_len = max(lens)
    block_size = k_cache.shape[1]
    nb = (max_len + block_size - 1) // block_size
    # Gather every sequence's blocks at once, padded to whole blocks: [S, nb * bs, Hk, D].
    idx = block_tables[:, :nb].reshape(-1).long()
    k = k_cache.index_select(0, idx).view(num_seqs, nb * block_size, num_kv_heads, head_dim)
    v = v_cache.index_select(0, idx).view(num_seqs, nb * block_size, num_kv_heads, head_dim)
    # fp32 and bf16 run natively (SDPA accumulates in fp32); fp16 on the CPU is upcast.
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
    # The G query heads of a KV head act as G queries of one SDPA "sequence":
    # q [S, Hk, G, D] against k, v [S, Hk, L, D], with the padding masked out.
    qf = q.to(dt).view(num_seqs, num_kv_heads, group, head_dim)
    mask = torch.arange(nb * block_size, device=q.device)[None, :] < seq_lens.to(q.device)[:, None].long()
    out = F.scaled_dot_product_attention(
        qf, k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed, no padding
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] context length after this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] offsets of each sequence's queries in q
    scale: float,
    max_query_len: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for new tokens whose earlier context is already cached.

    A sequence's queries are the last `q_len` positions of its context, so the
    same call serves plain prefill, chunked prefill, prefix-cache hits and decode.
    """
    if window > 0 or softcap > 0 or sinks is not None:
        return _variant_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window, softcap, sinks
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        q_len = b - a
        if q_len == 0:
            continue
        k = _gather(k_cache, block_tables[s], ctx).to(dt)  # [ctx, Hk, D]
        v = _gather(v_cache, block_tables[s], ctx).to(dt)
        qs = q[a:b].to(dt).transpose(0, 1)  # [H, q, D]
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [Hk, ctx, D]; SDPA maps head h to h // group
        if q_len == ctx:
            o = F.scaled_dot_product_attention(qs, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:  # queries are the last q_len positions: query i sees keys <= ctx - q_len + i
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        o = o.transpose(0, 1)  # [q, H, D]
        out[a:b] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def _variant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """paged_prefill_attention_ref with a window, a soft-cap or sinks: the scores written out
    in float32, each sequence reading only the positions its queries can see."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        first = ctx - (b - a)  # the first query's position
        lo = max(0, first - window + 1) if window > 0 else 0
        blocks = block_tables[s, lo // block_size : (ctx + block_size - 1) // block_size].long()
        skip = lo % block_size
        k = k_cache[blocks].flatten(0, 1)[skip : skip + ctx - lo].float()  # [ctx - lo, Hk, D]
        v = v_cache[blocks].flatten(0, 1)[skip : skip + ctx - lo].float()
        q_pos = torch.arange(first, ctx, device=q.device)
        k_pos = torch.arange(lo, ctx, device=q.device)
        out[a:b] = attend_ref(q[a:b].float(), k, v, q_pos, k_pos, scale, window, softcap, sinks).to(q.dtype)
    return out


def attend_ref(
    q: torch.Tensor,  # [n, H, D] float32 at positions q_pos [n]
    k: torch.Tensor,  # [m, Hk, D] float32 at positions k_pos [m]
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [n, H, D] float32
    """The variants' definition: scores, soft-cap, the causal and window mask, the softmax
    with the sink's logit in its denominator, the weighted values."""
    group = q.shape[1] // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(group, 0)  # [H, m, D]
    vh = v.transpose(0, 1).repeat_interleave(group, 0)
    scores = q.transpose(0, 1) @ kh.transpose(1, 2) * scale  # [H, n, m]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    seen = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~seen, -torch.inf)
    if sinks is not None:  # one more logit per head whose value is zero
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(0, 1)
