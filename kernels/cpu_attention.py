"""Paged attention on the CPU, planned once per step and shared by every layer.

The references in `paged_attention.py` are written to be obviously right; this is
written to be fast on a CPU, where every torch op costs a few microseconds of
dispatch and the fused SDPA kernel has a large fixed cost with boolean masks:

- **Decode rows** (the leading rows with one new token; the scheduler puts decodes
  first) are batched. With the native build (float32 and bfloat16) one C++ call per
  layer (kernels/cpu/attention.cpp) reads each row's context through its block table
  in place: no gather, no padding, no mask. At 32 rows it took a quarter of the time of
  the torch version (docs/benchmarks.md), which is: one `index_select` per K and V over
  a block index built once per step, one SDPA call with an additive mask built once
  per step; the gather reads only the columns of the block table that the longest
  context needs.
- **A fresh prompt** (no cached prefix: its queries are its whole context) attends
  to its own new K and V straight from the projection: no gather at all.
- **A short prompt row** (at most `SHORT_PROMPT_TOKENS`: a long prompt's chunk at the step
  pacer's floor beside running streams, a short new prompt) runs each of its tokens as a
  decode row of the native kernel over its own context, which is exact causal attention
  because the step's K and V are all stored before any row attends. A step of decodes and
  short rows only is then decode-shaped, so the model runs it in its one-call decode
  stack. The rule is the row's own, so a prompt's result does not depend on what it is
  batched with (the same bits alone or beside a long prompt).
- **A prompt chunk or a prefix-cache hit** gathers its own context (no padding to
  the batch's longest) and runs SDPA with the queries at the end, under an additive
  mask built once per step.

Every SDPA call gets 4-D inputs: torch's fused CPU kernel (flash attention for CPU)
only takes those; 3-D ones fall back to the unfused math path, 2.5-4x slower at
prompt sizes (docs/benchmarks.md).

Cache layout as everywhere: `[num_blocks, block_size, num_kv_heads, head_dim]`. The
cache may hold a narrower type than the activations (a float16 cache under a float32
model, `--kv-cache-dtype`): K and V are rounded to it as they are stored, the native
decode kernel widens them as it reads, and the torch paths cast what they gather to
the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cpu_ops import native_cache, native_cache_pair, native_ext, native_isa

# A prompt row of this many tokens or fewer (a long prompt's chunk beside running streams, at the
# step pacer's floor) runs each token as a decode row of the native kernel; a step of such rows and
# decodes is then decode-shaped, so the model runs it in its one-call decode stack
# (CausalLM.forward) instead of layer by layer: 16 SmolLM2 streams beside a 4-8 token
# chunk of a 1,500-token prompt, one thread of a 2-core AVX2 EPYC, took a forward of ~95 ms
# against ~115 (alternating runs). Each row reads its whole context, so past a few dozen queries
# at a long context the gather and SDPA below is cheaper (2.96 against 1.81 ms a layer for 32
# queries at 1,500).
SHORT_PROMPT_TOKENS = 16


@dataclass(slots=True)
class PrefillRow:
    q_start: int  # this row's queries are q[q_start:q_end]
    q_end: int
    context: int  # tokens it attends to, its new ones included (the last q_end - q_start)
    blocks: torch.Tensor | None  # [ceil(context / block_size)] int64; None: a fresh prompt
    bias: torch.Tensor | None = None  # [q_len, context]: 0 where a query sees a key, else -inf
    # A short row (SHORT_PROMPT_TOKENS) on the native kernel, a decode row per query: its
    # block table [q_len, blocks] int32 and each query's context [q_len] int32
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None


@dataclass(slots=True)
class CpuAttentionPlan:
    num_decodes: int  # rows [0, num_decodes) have one query each and are batched
    decode_index: torch.Tensor | None  # [num_decodes * width] int64: blocks to gather
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, width * block_size]: 0 or -inf
    width: int  # block-table columns the decode rows read
    prefills: list[PrefillRow] = field(default_factory=list)
    # Rotary tables for this step's positions, shared by every layer: x * cos + rot(x) * sin
    # with rot(x) = x rolled by half the head (see rotate()). [num_tokens, 1, head_dim]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, every slot valid
    # The native decode kernel's inputs (None: the torch version, decode_index and decode_bias)
    decode_tables: torch.Tensor | None = None  # [num_decodes, width] int32
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32


def plan_cpu_attention(
    tables: Sequence[Sequence[int]],  # per row: its block table (may be longer than needed)
    seq_lens: Sequence[int],  # per row: context length after this step
    q_lens: Sequence[int],  # per row: new tokens this step
    block_size: int,
    dtype: torch.dtype = torch.float32,  # the activations' (q's)
    positions: torch.Tensor | None = None,  # [num_tokens] int64, for the rotary tables
    cos_sin_cache: torch.Tensor | None = None,  # [max_pos, head_dim]: cos | sin halves
    slot_mapping: torch.Tensor | None = None,  # [num_tokens] int64, no -1
    kv_dtype: torch.dtype | None = None,  # the cache's; None: dtype
) -> CpuAttentionPlan:
    native = native_decode(dtype, kv_dtype or dtype)
    if native and q_lens and 1 < max(q_lens) <= SHORT_PROMPT_TOKENS:  # decode-shaped: one call a layer
        tables, seq_lens, q_lens = _one_query_per_row(tables, seq_lens, q_lens)
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    index = bias = dtables = dlens = None
    width = 0
    if num_decodes:
        lens = seq_lens[:num_decodes]
        width = (max(lens) + block_size - 1) // block_size
        rows = []
        for t in tables[:num_decodes]:
            row = list(t[:width])
            rows.extend(row + [0] * (width - len(row)))  # padding blocks are masked out
    if num_decodes and native:
        dtables = torch.tensor(rows, dtype=torch.int32).view(num_decodes, width)
        dlens = torch.tensor(lens, dtype=torch.int32)
    elif num_decodes:
        index = torch.tensor(rows, dtype=torch.long)
        pos = torch.arange(width * block_size)
        masked = pos[None, :] >= torch.tensor(lens)[:, None]
        bias = torch.zeros(num_decodes, 1, 1, width * block_size, dtype=dtype)
        bias.masked_fill_(masked[:, None, None, :], -torch.inf)
    prefills = []
    start = num_decodes
    for t, ctx, n in zip(tables[num_decodes:], seq_lens[num_decodes:], q_lens[num_decodes:], strict=True):
        blocks = row_bias = None
        if native and n <= SHORT_PROMPT_TOKENS:  # beside a long prompt: the same kernel, the same bits
            used, lens, _ = _one_query_per_row([t[: (ctx + block_size - 1) // block_size]], [ctx], [n])
            row_tables = torch.tensor([list(u) for u in used], dtype=torch.int32)
            row_lens = torch.tensor(lens, dtype=torch.int32)
            prefills.append(PrefillRow(start, start + n, ctx, None, None, row_tables, row_lens))
            start += n
            continue
        if n != ctx:
            blocks = torch.tensor(list(t[: (ctx + block_size - 1) // block_size]))
            # queries are the last n positions: query i sees keys <= ctx - n + i
            row_bias = torch.zeros(n, ctx, dtype=dtype).masked_fill_(
                torch.ones(n, ctx, dtype=torch.bool).triu_(ctx - n + 1), -torch.inf
            )
        prefills.append(PrefillRow(start, start + n, ctx, blocks, row_bias))
        start += n
    cos = sin = None
    if positions is not None and cos_sin_cache is not None:
        half = cos_sin_cache.shape[1] // 2
        cs = cos_sin_cache.index_select(0, positions).float()  # exact; the native op reads fp32
        cos = torch.cat([cs[:, :half], cs[:, :half]], dim=1)[:, None, :]
        sin = torch.cat([-cs[:, half:], cs[:, half:]], dim=1)[:, None, :]
    return CpuAttentionPlan(num_decodes, index, bias, width, prefills, cos, sin, slot_mapping, dtables, dlens)


def _one_query_per_row(
    tables: Sequence[Sequence[int]], seq_lens: Sequence[int], q_lens: Sequence[int]
) -> tuple[list[Sequence[int]], list[int], list[int]]:
    """Every prompt token as a decode row of its own: the query at position p reads the
    context [0, p] through its sequence's block table. Exact causal attention because the
    native block stores every row's K and V before any row attends (rope_store_decode)."""
    out_tables: list[Sequence[int]] = []
    out_lens: list[int] = []
    for t, ctx, n in zip(tables, seq_lens, q_lens, strict=True):
        out_tables += [t] * n
        out_lens += range(ctx - n + 1, ctx + 1)
    return out_tables, out_lens, [1] * len(out_lens)


def native_decode(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decode rows of this dtype over a cache of kv_dtype (None: the same) go to the
    native kernel: built, float32 or bfloat16 queries, a cache of theirs or a half type."""
    return native_cache_pair(dtype, kv_dtype or dtype) and native_ext() is not None


def rotate(x: torch.Tensor, plan: CpuAttentionPlan) -> None:
    """Rotary embedding in place on x [num_tokens, heads, head_dim] (q and k side by side
    is fine). x1*cos - x2*sin | x2*cos + x1*sin, as the reference rounds it: the roll
    puts x2 | x1 under sin's -sin | sin halves, and a + (-b) is exactly a - b."""
    assert plan.cos is not None and plan.sin is not None
    xf = x if x.dtype == torch.float32 else x.float()  # half types: in fp32, rounded once
    rolled = xf.roll(x.shape[-1] // 2, dims=-1).mul_(plan.sin)
    x.copy_(torch.mul(xf, plan.cos).add_(rolled))


def cpu_attention_block(
    qkv: torch.Tensor,  # [num_tokens, (H + 2 Hk) * D]: the fused projection's output
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    num_heads: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, H * D]
    """Rotary on q and k, KV store, attention: one layer's attention on the CPU."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    t = qkv.shape[0]
    ext = native_cache(qkv, k_cache)
    if ext is not None:  # rotary and the KV store in one native call
        assert plan.cos is not None and plan.sin is not None and plan.slot_mapping is not None
        if not plan.prefills and plan.decode_tables is not None:  # a pure decode step: one call
            return ext.rope_store_decode(
                qkv,
                plan.cos,
                plan.sin,
                k_cache,
                v_cache,
                plan.slot_mapping,
                num_heads,
                plan.decode_tables,
                plan.decode_lens,
                scale,
                native_isa(),
            )
        ext.rope_store(qkv, plan.cos, plan.sin, k_cache, v_cache, plan.slot_mapping, num_heads)
        if not plan.prefills:  # a pure decode step reads K and V from the cache alone
            q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
            o = _decode(q, k_cache, v_cache, plan, scale, num_heads // num_kv_heads)
            return o.reshape(t, num_heads * head_dim)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(t, num_heads + num_kv_heads, head_dim)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
    if ext is None:
        rotate(qk, plan)
        assert plan.slot_mapping is not None
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
    return cpu_paged_attention(q, k, v, k_cache, v_cache, plan, scale).reshape(t, num_heads * head_dim)


def cpu_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (already stored)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    group = q.shape[1] // k_cache.shape[2]
    if not plan.prefills:  # a pure decode step: no output buffer to fill piecewise
        return _decode(q, k_cache, v_cache, plan, scale, group)
    out = torch.empty_like(q)
    if plan.num_decodes:
        out[: plan.num_decodes] = _decode(q[: plan.num_decodes], k_cache, v_cache, plan, scale, group)
    for row in plan.prefills:
        a, b = row.q_start, row.q_end
        if row.lens is not None:  # a short row: a decode row per query
            ext = native_ext()
            assert ext is not None and row.tables is not None
            o = ext.decode_attention(q[a:b], k_cache, v_cache, row.tables, row.lens, scale, native_isa())
            out[a:b] = o.view(b - a, *q.shape[1:])
            continue
        qs = q[a:b].transpose(0, 1)[None]  # [1, H, q_len, D]
        if row.blocks is None:  # fresh prompt: its context is exactly its new tokens
            # as the cache holds them (a half cache: rounded), so that a later read of these
            # blocks (a prefix hit, a recompute, decode) sees the same K and V
            ks = _as(_as(k[a:b], k_cache.dtype), q.dtype).transpose(0, 1)[None]
            vs = _as(_as(v[a:b], v_cache.dtype), q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = row.context
            # [1, Hk, ctx, D] in q's dtype (a half cache is widened: SDPA takes one dtype)
            ks = _as(k_cache.index_select(0, row.blocks), q.dtype).flatten(0, 1)[:ctx].transpose(0, 1)[None]
            vs = _as(v_cache.index_select(0, row.blocks), q.dtype).flatten(0, 1)[:ctx].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=row.bias, scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
    group: int,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if plan.decode_tables is not None:
        ext = native_ext()
        assert ext is not None
        o = ext.decode_attention(
            q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale, native_isa()
        )
        return o.view(n, num_heads, head_dim)
    assert plan.decode_index is not None and plan.decode_bias is not None
    length = plan.width * block_size
    # [n, L, Hk, D] -> [n, Hk, L, D] views; the G query heads of a KV head are its G queries.
    ks = _as(k_cache.index_select(0, plan.decode_index), q.dtype)
    vs = _as(v_cache.index_select(0, plan.decode_index), q.dtype)
    ks = ks.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    vs = vs.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
    qs = q.reshape(n, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.decode_bias, scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: itself when it is already (no copy), else widened (a half cache's blocks)."""
    return x if x.dtype is dtype else x.to(dtype)
