"""Paged prefill attention in Triton: packed varlen queries, causal, over the block tables.

A sequence's `q_len` queries are the last `q_len` positions of its `seq_len`-token
context; the K/V of the whole context, the new tokens included, is already in the
paged cache. So one kernel serves plain prefill (q_len == seq_len), chunked
prefill and prefix-cache hits (q_len < seq_len) and decode (q_len == 1).

Grid: (query tile, sequence, KV head). A program takes BLOCK_Q consecutive
queries of one sequence and all GROUP query heads of one KV head, laid out as
BLOCK_M = BLOCK_Q * G_PAD rows (row r = token r // G_PAD, head r % G_PAD), so the
K/V tiles it streams serve the whole GQA group. It walks the context from
position 0 up to its last query's position and masks keys after each query's own
position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import dot_flags, next_pow2, softcap2
from .paged_decode import _check

_LOG2E = 1.4426950408889634
_BLOCK_M = 64  # rows (query tokens x padded group) per program
_BLOCK_N = 64  # KV tokens per inner-loop tile


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    starts_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    window,
    cap2,
    s_qt,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_tab,
    s_ot,
    s_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq).to(tl.int32)
    q_len = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(lens_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_Q * G_PAD)
    tok = tile * BLOCK_Q + r // G_PAD  # query index within the sequence
    g = r % G_PAD
    heads = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    row_mask = (tok < q_len) & (g < GROUP)
    q_pos = ctx - q_len + tok  # the query's position in its context
    q_rows = (q_start + tok).to(tl.int64) * s_qt + heads * s_qh
    # q: [BLOCK_M, D_PAD]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    if HAS_SINKS:  # each head's sink as one more key, whose value is zero
        m_i = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_Q * G_PAD], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = tables_ptr + seq.to(tl.int64) * s_tab
    # keys up to the tile's last query position, inclusive; with a window, from the first
    # query's window on (the blocks before it are never read)
    kv_end = tl.minimum(ctx, ctx - q_len + tl.minimum((tile + 1) * BLOCK_Q, q_len))
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(ctx - q_len + tile * BLOCK_Q - window + 1, 0)
    for t0 in range(kv_start, kv_end, BLOCK_N):
        kt = t0 + n
        t_mask = kt < kv_end
        blk = tl.load(table + kt // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = kt % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + (blk * s_kb + off * s_kt + kvh * s_kh)[:, None] + d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            v_ptr + (blk * s_vb + off * s_vt + kvh * s_vh)[:, None] + d[None, :], mask=kv_mask, other=0.0
        )
        k = k.to(q.dtype)
        # scores in base 2: [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = softcap2(s, cap2)
        seen = (kt[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if HAS_WINDOW:
            seen = seen & (kt[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key yet (only with seq_len < q_len, bad input) stays at -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * s_ot + heads * s_oh
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed, no padding
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] context length after this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] offsets of each sequence's queries in q
    scale: float,
    max_query_len: int | None = None,  # an upper bound on any q_len; None: read it (host sync)
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """The variant (paged_attention.py): a query tile walks keys from its first query's
    window on, masked per query; a soft-cap caps the base-2 scores; sinks start each row's
    softmax as one more key of value zero."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    _check(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_dim, block_size)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = next_pow2(group)
    block_q = max(1, _BLOCK_M // g_pad)  # rows = block_q * g_pad >= 64: tl.dot wants >= 16
    upcast, precision = dot_flags(q.dtype, q.device)
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        out if sinks is None else sinks,
        scale * _LOG2E,
        max(int(window), 0),
        float(softcap) * _LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N if q.element_size() < 4 else _BLOCK_N // 2,  # fp32: under 100 KB shared
        UPCAST=upcast,
        PRECISION=precision,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out
