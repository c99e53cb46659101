"""Paged decode attention in Triton: flash-decoding over the block tables.

One program serves (sequence, KV head, split): it loads the queries of every head
in that KV head's group as one [G_PAD, D_PAD] tile, so each K/V byte is read once
per step however large the GQA ratio is. A sequence's context is cut into as many
splits as the grid has, each a whole number of BLOCK_N tiles; each split writes its
normalised partial output and its log-sum-exp, and a second kernel merges the
splits. With a single split the first kernel writes the output directly and the
merge is skipped.

The launch plan (the split count) depends only on tensor shapes (batch, KV heads,
block-table width) and the SM count, never on the values in `seq_lens`, so the call
needs no host sync and can be captured in a CUDA graph. The split *size* is each
sequence's own, computed on the device from its length: a graph captured for a
batch bucket over block tables as wide as the longest context still cuts a short
context into few full tiles (the splits past its end return at once), and a long
one into many. So one graph per batch bucket serves every context length.

Batch 1 at 1k-4k tokens is the case that needs the splits: 8 KV heads make 8
programs, which cannot stream the cache on a GPU of 132 SMs; cut into 64-token
splits they make 128-512 (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import dot_flags, next_pow2, num_sms, softcap2

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # KV tokens per inner-loop tile, and the shortest split
_WAVES = 4  # programs per SM the split count aims at: enough loads in flight to stream the cache


@triton.jit(do_not_specialize=["window"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    sinks_ptr,
    qk_scale,
    window,
    cap2,
    s_qs,
    s_qh,
    s_kb,
    s_kt,
    s_kh,
    s_vb,
    s_vt,
    s_vh,
    s_tab,
    s_os,
    s_oh,
    s_ps,
    s_ph,
    s_pp,
    s_ls,
    s_lh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    lo = 0  # the first position the query sees: its last `window` ones with a window
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # This sequence's split size: what it sees over the grid's splits, in whole tiles. A
    # padded row (length 0) and the splits past a short context's end loop zero times.
    partition = tl.cdiv(tl.cdiv(seq_len - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = lo + split * partition
    end = tl.minimum(start + partition, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    # q: [G_PAD, D_PAD], the whole GQA group of this KV head
    q = tl.load(q_ptr + seq * s_qs + heads[:, None] * s_qh + d[None, :], mask=gd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if HAS_SINKS:  # split 0 takes each head's sink as one more key, whose value is zero
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = tables_ptr + seq.to(tl.int64) * s_tab
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + n
        t_mask = tok < end
        blk = tl.load(table + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = tok % BLOCK_SIZE
        kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
        k_rows = blk * s_kb + off * s_kt + kvh * s_kh
        k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v_rows = blk * s_vb + off * s_vt + kvh * s_vh
        v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # scores in base 2: [G_PAD, BLOCK_N]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = softcap2(s, cap2)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (start >= seq_len) has l_i == 0: it writes zeros and lse -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SINGLE:
        o_ptrs = out_ptr + seq * s_os + heads[:, None] * s_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        p_base = part_ptr + seq.to(tl.int64) * s_ps + split * s_pp
        tl.store(p_base + heads[:, None] * s_ph + d[None, :], o, mask=gd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + seq.to(tl.int64) * s_ls + heads * s_lh + split, lse, mask=g < GROUP)


# num_splits not specialised (a value of 16 or 32 would compile a variant of its own), and no
# power-of-two bound on it as a constexpr: the merge loops over the splits P_CHUNK at a time,
# so the eager step, whose split count follows its batch, never compiles a kernel mid-serving.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    s_ps,
    s_ph,
    s_pp,
    s_ls,
    s_lh,
    s_os,
    s_oh,
    num_splits,
    P_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    pc = tl.arange(0, P_CHUNK)
    d = tl.arange(0, D_PAD)
    lse_row = lse_ptr + seq.to(tl.int64) * s_ls + head * s_lh
    # the largest log-sum-exp (base 2) over the splits
    m_vec = tl.full([P_CHUNK], float("-inf"), tl.float32)
    for p0 in range(0, num_splits, P_CHUNK):
        sp = p0 + pc
        m_vec = tl.maximum(m_vec, tl.load(lse_row + sp, mask=sp < num_splits, other=float("-inf")))
    m = tl.max(m_vec, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # each split's output weighed by exp2(lse - max): an empty split (lse -inf) weighs 0
    base = part_ptr + seq.to(tl.int64) * s_ps + head * s_ph
    acc = tl.zeros([D_PAD], tl.float32)
    w_sum = tl.zeros([P_CHUNK], tl.float32)
    for p0 in range(0, num_splits, P_CHUNK):
        sp = p0 + pc
        sp_mask = sp < num_splits
        w = tl.exp2(tl.load(lse_row + sp, mask=sp_mask, other=float("-inf")) - m_safe)  # [P_CHUNK]
        pd_mask = sp_mask[:, None] & (d < HEAD_DIM)[None, :]
        parts = tl.load(base + sp[:, None] * s_pp + d[None, :], mask=pd_mask, other=0.0)  # [P_CHUNK, D_PAD]
        acc += tl.sum(parts * w[:, None], 0)
        w_sum += w
    total = tl.sum(w_sum, 0)
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * s_os + head * s_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def plan_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many splits each sequence's context is cut into, from shapes only.

    Enough (sequence, KV head, split) programs for _WAVES per SM, but no more splits
    than the longest context has BLOCK_N tiles: batch 1 with 8 KV heads on 132 SMs
    takes 66 (a 4k context in 64 splits of 64 tokens, a 1k one in 16), batch 64 takes
    2, batch 128 and up 1.
    """
    target = _WAVES * num_sms(device)
    want = triton.cdiv(target, max(num_seqs * num_kv_heads, 1))
    most = triton.cdiv(max(max_context, 1), _BLOCK_N)
    return max(1, min(want, most))


def paged_decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] context length, the current token included
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    num_splits: int | None = None,  # None: plan_splits(); tests force other values
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """The variant (paged_attention.py): a window starts each row's splits at its window; a
    soft-cap caps the base-2 scores; split 0 counts the sinks, so the merge weighs them once."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    _check(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_dim, block_size)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    splits = num_splits or plan_splits(num_seqs, num_kv_heads, max_context, q.device)
    d_pad = next_pow2(head_dim)
    upcast, precision = dot_flags(q.dtype, q.device)
    single = splits == 1
    if single:
        part = lse = out  # unused by the kernel
        part_strides = (0, 0, 0, 0, 0)
    else:
        # part: [num_seqs, num_heads, splits, D_PAD] fp32; lse: the same without D_PAD
        part = torch.empty((num_seqs, num_heads, splits, d_pad), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
        part_strides = (*part.stride()[:3], lse.stride(0), lse.stride(1))
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part,
        lse,
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
        *part_strides,
        GROUP=group,
        G_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N,
        SINGLE=single,
        UPCAST=upcast,
        PRECISION=precision,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    if not single:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part,
            lse,
            out,
            *part_strides,
            out.stride(0),
            out.stride(1),
            splits,
            P_CHUNK=16,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            num_warps=4,
        )
    return out


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dim: int,
    block_size: int,
) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}"
        )
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous")
