"""Row ops written for the CPU: the same results as the references, in fewer torch ops.

On a CPU every torch op costs a few microseconds of dispatch whatever its size, and a
decode step of a small model runs thousands of them. These versions cut the count
(fused RMSNorm, q and k rotated as one tensor when they sit side by side in the fused
qkv output, no masking pass in the KV store) and stay bit-identical to the references
in fp32 (tests/unit/test_kernels_cpu.py). Other dtypes use the references, whose
rounding follows HF's.

With the native build (kernels/native.py) these are one C++ call each
(kernels/cpu/rowops.cpp): rotary with the KV store (float32 and bfloat16, the
reference's bits; a float16 cache, or bfloat16 under float32, gets K and V rounded
to nearest as torch's .to() rounds), RMSNorm with its residual add and SiLU-and-mul
(float32 and bfloat16, whose references take 3 to 15 ops; the references' rounding,
but the sum of squares in another order and a vector exp, so the results may differ
from torch's in the last bits: within row_op_tolerance). Those two run in AVX-512 or
AVX2 vectors (kernels/cpu/rows_simd.h) on the path quant.force_isa pins.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .kv_store import store_kv_ref
from .norms import rms_norm_ref
from .rotary import rotary_embedding_ref

_FUSED_RMS_NORM = getattr(torch, "_fused_rms_norm", None)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# The caches the native kernels read and write beside float32 / bfloat16 activations
_NATIVE_CACHES = {
    torch.float32: (torch.float32, torch.float16, torch.bfloat16),
    torch.bfloat16: (torch.bfloat16, torch.float16),
}


_modules: list[Any] = []  # [native, quant] once imported (the calls below run 100+ times a step)


def native_ext() -> Any:
    """The native extension, or None (kernels/native.py: built once, never raising)."""
    if not _modules:
        # here, not at the top: `python -m wsllm.kernels.native` must not find it imported
        from . import native, quant

        _modules.extend((native, quant))
    return _modules[0].extension()


def native_rows(x: torch.Tensor, other: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    """The native extension when it can take x (and `other`, of the same dtype): a
    contiguous float32/bfloat16 CPU matrix; else None (the torch versions run)."""
    if x.dtype not in _NATIVE_DTYPES or x.dim() != 2 or not x.is_contiguous():
        return None
    if other is not None and (other.dtype is not x.dtype or not other.is_contiguous()):
        return None
    return native_ext()


def native_cache_pair(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the native KV kernels take activations of dtype over a cache of kv_dtype:
    the same, or a half type they convert (float16; bfloat16 under float32)."""
    return kv_dtype in _NATIVE_CACHES.get(dtype, ())


def native_cache(x: torch.Tensor, cache: torch.Tensor):  # type: ignore[no-untyped-def]
    """The native extension when its KV kernels take activations x (rows, as native_rows)
    and this contiguous cache (native_cache_pair); else None."""
    if not native_cache_pair(x.dtype, cache.dtype) or not cache.is_contiguous():
        return None
    return native_rows(x)


def half_cache_native() -> bool:
    """Whether the native decode kernel reads a float16 cache in vectors on this CPU: built,
    and the AVX2 path runs here (AVX2, FMA and F16C, whose vcvtph2ps widens the halves)."""
    ext = native_ext()
    return ext is not None and bool(ext.cpu_has(_modules[1].ISAS.index("avx2")))


def native_isa() -> int:
    """The vector path the native ops take (quant.force_isa pins it for the tests); after native_ext()."""
    return _modules[1].isa_index()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]
    ext = native_rows(x, weight)
    if ext is not None:
        return ext.add_rms_norm(x, None, weight, eps, native_isa())[0]
    if x.dtype is not torch.float32 or weight.dtype is not torch.float32:
        return rms_norm_ref(x, weight, eps)
    if _FUSED_RMS_NORM is not None:
        return _FUSED_RMS_NORM(x, [x.shape[-1]], weight, eps)[0]
    return torch.rms_norm(x, [x.shape[-1]], weight, eps)


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ext = native_rows(x, weight)
    if ext is not None and residual.dtype is x.dtype and residual.is_contiguous():  # C++ checks the shape
        out, h = ext.add_rms_norm(x, residual, weight, eps, native_isa())
        return out, h
    h = x + residual
    return rms_norm_cpu(h, weight, eps), h


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * d] -> [num_tokens, d]; one split instead of two Python slices
    ext = native_rows(x)
    if ext is not None:
        return ext.silu_mul(x, native_isa())
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate).mul_(up)


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, H, D] and k [T, Hk, D] as one [T, H + Hk, D] view, when k's heads
    follow q's in memory with the same row stride (slices of the fused qkv output)."""
    if q.dim() != 3 or q.stride()[1:] != (q.shape[2], 1) or k.stride() != (q.stride(0), k.shape[2], 1):
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size():
        return None
    t, h, d = q.shape
    return q.as_strided((t, h + k.shape[1], d), (q.stride(0), d, 1))


def rotary_embedding_cpu(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]: cos | sin halves
) -> None:
    if q.dtype is not torch.float32:
        return rotary_embedding_ref(positions, q, k, cos_sin_cache)
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)[:, None, :]  # [T, 1, D]
    cos, sin = cs[..., :half], cs[..., half:]
    both = _side_by_side(q, k)
    for x in (q, k) if both is None else (both,):
        x1, x2 = x[..., :half], x[..., half:]
        o1 = torch.mul(x1, cos).sub_(x2 * sin)  # the reference's x1*cos - x2*sin, same rounding
        o2 = torch.mul(x2, cos).add_(x1 * sin)
        x1.copy_(o1)
        x2.copy_(o2)
    return None


def store_kv_cpu(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block * block_size + offset; -1 skips
) -> None:
    if bool((slot_mapping < 0).any()):  # the model runner never writes -1; others may
        return store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
