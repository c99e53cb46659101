"""Small helpers shared by the Triton kernel modules (these import triton)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """-> (UPCAST, DOT_PRECISION) constexprs for the attention kernels.

    fp32 inputs use IEEE products, not TF32: the fp32 path is the accuracy path.
    The CPU interpreter computes `tl.dot` on bf16 operands wrongly (triton 3.x), so
    there the kernels widen both operands to fp32 after rounding them as the GPU
    would; on CUDA the half types go to the tensor cores as they are.
    """
    upcast = device.type != "cuda" and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return upcast, precision


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; a small fixed number elsewhere
    (the interpreter), so that CPU tests exercise the split-KV path."""
    if device.type != "cuda":
        return 16
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def softcap2(s, cap2):
    """Base-2 scores s (natural scores times log2(e)) soft-capped at cap2 = softcap * log2(e):
    cap2 * tanh(s / cap2), tanh by one exp2 (tl has no tanh; +-inf at the far ends give +-1)."""
    e = tl.exp2((2.0 * 1.4426950408889634 / cap2) * s)
    return cap2 * (1.0 - 2.0 / (e + 1.0))
