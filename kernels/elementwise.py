"""Triton versions of the row-wise ops: store_kv, (add_)rms_norm, rotary_embedding,
silu_and_mul, gelu_tanh_and_mul.

Each one rounds where its torch reference rounds (to the input dtype between the
steps the reference runs as separate torch ops), so in fp32 they agree to a few
ulps and in half types they differ by at most one ulp of the output.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_common import next_pow2

# --------------------------------------------------------------------- store_kv


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_kcb,
    s_kct,
    s_kch,
    s_vcb,
    s_vct,
    s_vch,
    NUM_KV_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * s_kt + h[:, None] * s_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * s_vt + h[:, None] * s_vh + d[None, :], mask=mask)
    kc = kc_ptr + blk * s_kcb + off * s_kct + h[:, None] * s_kch + d[None, :]
    vc = vc_ptr + blk * s_vcb + off * s_vct + h[:, None] * s_vch + d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int: block * block_size + offset; -1 skips
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous")
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        H_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


# -------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    s_x,
    s_r,
    s_o,
    s_h,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * s_r + c, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * s_h + c, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    # round to the input dtype before the weight multiply, as HF (and the reference) do
    y = (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + c, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden}")
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    o2 = out.view(-1, hidden)
    if residual is None:
        r2, h2 = x2, x2  # h2 only tells the kernel the dtype to round to
    else:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
        h2 = h.view(-1, hidden)
    block = next_pow2(hidden)
    if block > 65536:
        raise ValueError(f"hidden size {hidden} is larger than this kernel handles (65536)")
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight.contiguous(),
            o2,
            h2,
            x2.stride(0),
            r2.stride(0),
            o2.stride(0),
            h2.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out, (x if residual is None else h)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) from one pass over the row."""
    return _rms_norm(x, residual, weight, eps)


# -------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(
    base, s_h, cos, sin, j, j_mask, N_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr
):
    h = tl.arange(0, H_PAD)
    mask = (h < N_HEADS)[:, None] & j_mask[None, :]
    p1 = base + h[:, None] * s_h + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cs_ptr,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    s_cs,
    NQ: tl.constexpr,
    NQ_PAD: tl.constexpr,
    NK: tl.constexpr,
    NK_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF
    cos = tl.load(cs_ptr + pos * s_cs + j, mask=j_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * s_qt, s_qh, cos, sin, j, j_mask, NQ, NQ_PAD, HALF)
    _rotate_heads(k_ptr + t * s_kt, s_kh, cos, sin, j, j_mask, NK, NK_PAD, HALF)


def rotary_embedding_triton(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]: cos | sin
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos_sin_cache "
            f"{tuple(cos_sin_cache.shape)} do not fit together"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding works in place: q's and k's head_dim axis must be contiguous")
    if num_tokens == 0:
        return
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cs.stride(0),
        NQ=num_heads,
        NQ_PAD=next_pow2(num_heads),
        NK=num_kv_heads,
        NK_PAD=next_pow2(num_kv_heads),
        HALF=half,
        HALF_PAD=next_pow2(half),
    )


# ---------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < d
    g = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + d + c, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # silu rounds to the dtype before the product, as F.silu(...) * up does
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * s_o + c, (a * u).to(dtype), mask=mask)


def _gated_triton(kernel: Any, x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]: act(gate) * up by `kernel`."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, d)
    block = min(1024, next_pow2(d))
    if x2.shape[0] and d:
        kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, o2, x2.stride(0), o2.stride(0), d, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_triton(_silu_and_mul_kernel, x)


# ----------------------------------------------------------- gelu_tanh_and_mul


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < d
    g = tl.load(x_ptr + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_x + d + c, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # gelu's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) as
    # 1 - 2 / (e^(2z) + 1); rounded to the dtype before the product, as F.gelu(...) * up does
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    a = (0.5 * g * (1.0 + t)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * s_o + c, (a * u).to(dtype), mask=mask)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_triton(_gelu_tanh_and_mul_kernel, x)  # GeGLU: Gemma's MLP
