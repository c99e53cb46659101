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

A layer's attention variant (paged_attention.py: `window`, `softcap`, `sinks`, per layer, so
the plan stays shared): decode rows and short rows pass it to the native kernel. A prompt
row of a layer with a soft-cap or sinks, which SDPA cannot take, runs a decode row per query
on the native kernel too (the reference's float32 scores without a build). A window alone
keeps SDPA: the row gathers from the first block its first query's window reaches, under a
mask that is causal and windowed (built once per step and window), so that no path reads a
block before the window.

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_attention_plan import (
    SHORT_PROMPT_TOKENS,
    CpuAttentionPlan,
    PrefillRow,
    decode_rows,
    native_decode,
    plan_cpu_attention,
    window_view,
)
from .cpu_ops import native_cache, native_ext, native_isa
from .paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref

__all__ = [
    "SHORT_PROMPT_TOKENS",
    "CpuAttentionPlan",
    "PrefillRow",
    "Variant",
    "cpu_attention_block",
    "cpu_paged_attention",
    "native_decode",
    "plan_cpu_attention",
    "rotate",
]


def rotate(x: torch.Tensor, plan: CpuAttentionPlan, rope: int = 0) -> None:
    """Rotary embedding in place on x [num_tokens, heads, head_dim] (q and k side by side
    is fine) by the plan's table `rope`. x1*cos - x2*sin | x2*cos + x1*sin, as the reference
    rounds it: the roll puts x2 | x1 under sin's -sin | sin halves, and a + (-b) is exactly a - b."""
    cos, sin = plan.cos_sin(rope)
    xf = x if x.dtype == torch.float32 else x.float()  # half types: in fp32, rounded once
    rolled = xf.roll(x.shape[-1] // 2, dims=-1).mul_(sin)
    x.copy_(torch.mul(xf, cos).add_(rolled))


def cpu_attention_block(
    qkv: torch.Tensor,  # [num_tokens, (H + 2 Hk) * D]: the fused projection's output
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    num_heads: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    rope: int = 0,  # the layer's rotary table (CpuAttentionPlan.cos_sin)
) -> torch.Tensor:  # [num_tokens, H * D]
    """Rotary on q and k, KV store, attention: one layer's attention on the CPU (with the
    layer's variant, paged_attention.py)."""
    var = Variant(window, softcap, sinks)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    t = qkv.shape[0]
    ext = native_cache(qkv, k_cache)
    if ext is not None:  # rotary and the KV store in one native call
        cos, sin = plan.cos_sin(rope)
        assert plan.slot_mapping is not None
        if not plan.prefills and plan.decode_tables is not None:  # a pure decode step: one call
            return ext.rope_store_decode(
                qkv,
                cos,
                sin,
                k_cache,
                v_cache,
                plan.slot_mapping,
                num_heads,
                plan.decode_tables,
                plan.decode_lens,
                scale,
                native_isa(),
                **var.kwargs(),
            )
        ext.rope_store(qkv, cos, sin, k_cache, v_cache, plan.slot_mapping, num_heads)
        if not plan.prefills:  # a pure decode step reads K and V from the cache alone
            q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
            o = _decode(q, k_cache, v_cache, plan, scale, num_heads // num_kv_heads, var)
            return o.reshape(t, num_heads * head_dim)
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(t, num_heads + num_kv_heads, head_dim)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
    if ext is None:
        rotate(qk, plan, rope)
        assert plan.slot_mapping is not None
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
    o = cpu_paged_attention(
        q, k, v, k_cache, v_cache, plan, scale, window=window, softcap=softcap, sinks=sinks
    )
    return o.reshape(t, num_heads * head_dim)


@dataclass(slots=True, frozen=True)
class Variant:
    """A layer's attention variant (paged_attention.py), each part off by default."""

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return {"window": self.window, "softcap": self.softcap, "sinks": self.sinks}

    def plain(self) -> bool:
        return self.window <= 0 and self.softcap <= 0 and self.sinks is None


def cpu_paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (already stored)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    var = Variant(window, softcap, sinks)
    group = q.shape[1] // k_cache.shape[2]
    if not plan.prefills:  # a pure decode step: no output buffer to fill piecewise
        return _decode(q, k_cache, v_cache, plan, scale, group, var)
    out = torch.empty_like(q)
    if plan.num_decodes:
        out[: plan.num_decodes] = _decode(q[: plan.num_decodes], k_cache, v_cache, plan, scale, group, var)
    for row in plan.prefills:
        a, b = row.q_start, row.q_end
        if row.lens is not None or softcap > 0 or sinks is not None:  # a decode row per query
            out[a:b] = _asdecode_rows(q[a:b], k_cache, v_cache, row, scale, var)
            continue
        if window > 0 and row.context > window:  # the window cuts the context
            out[a:b] = _windowed_row(q[a:b], k[a:b], v[a:b], k_cache, v_cache, row, scale, window)
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


def _asdecode_rows(
    q: torch.Tensor,  # [q_len, H, D]: the row's queries
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    scale: float,
    var: Variant,
) -> torch.Tensor:  # [q_len, H, D]
    """A prompt row as one decode row per query on the native kernel (a short row's tables,
    or ones made for a soft-capped or sunk layer); the reference without a build."""
    n = q.shape[0]
    if n == 0:  # a row with no query this step: nothing to attend
        return q.clone()
    ext = native_ext() if native_decode(q.dtype, k_cache.dtype) else None
    if ext is None:
        table = torch.tensor([list(row.table)], dtype=torch.int32)
        ctx, starts = torch.tensor([row.context]), torch.tensor([0, n])
        return paged_prefill_attention_ref(q, k_cache, v_cache, table, ctx, starts, scale, **var.kwargs())
    tables, lens = row.tables, row.lens
    if lens is None:
        if row.q_lens is None:
            row.q_tables, row.q_lens = decode_rows(row.table, row.context, n)
        tables, lens = row.q_tables, row.q_lens
    o = ext.decode_attention(q, k_cache, v_cache, tables, lens, scale, native_isa(), **var.kwargs())
    return o.view(q.shape)


def _windowed_row(
    q: torch.Tensor,  # [q_len, H, D]: the row's queries
    k: torch.Tensor,  # [q_len, Hk, D]: its new keys (already stored)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: PrefillRow,
    scale: float,
    window: int,
) -> torch.Tensor:  # [q_len, H, D]
    """SDPA over the keys from the first block the row's first query's window reaches (a
    fresh prompt: its own K and V), under a causal and windowed mask."""
    found = row.windows.get(window)
    if found is None:
        found = row.windows[window] = window_view(row, window, k_cache.shape[1], q.dtype)
    lo, blocks, bias = found
    if blocks is None:  # a fresh prompt: its own K and V as the cache holds them (see below)
        ks = _as(_as(k, k_cache.dtype), q.dtype).transpose(0, 1)[None]
        vs = _as(_as(v, v_cache.dtype), q.dtype).transpose(0, 1)[None]
    else:  # [1, Hk, context - lo, D]
        ks = _as(k_cache.index_select(0, blocks), q.dtype).flatten(0, 1).transpose(0, 1)[None]
        vs = _as(v_cache.index_select(0, blocks), q.dtype).flatten(0, 1).transpose(0, 1)[None]
        ks, vs = ks[:, :, : row.context - lo], vs[:, :, : row.context - lo]
    qs = q.transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
    group: int,
    var: Variant,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if plan.decode_tables is not None:
        ext = native_ext()
        assert ext is not None
        o = ext.decode_attention(
            q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale, native_isa(), **var.kwargs()
        )
        return o.view(n, num_heads, head_dim)
    assert plan.decode_index is not None and plan.decode_bias is not None
    if not var.plain():  # no build: the reference
        tables = plan.decode_index.view(n, plan.width)
        return paged_decode_attention_ref(
            q, k_cache, v_cache, tables, plan.decode_lens, scale, **var.kwargs()
        )
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
