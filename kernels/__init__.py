"""Kernels used by the model, imported as `wsllm.kernels`.

Each op has a plain-torch reference (the CPU path and the test oracle) and, where
Triton is available, a Triton kernel with the same signature. `use_backend()`
picks which one the public names call: "torch" (the references), "triton", or
"auto": Triton on CUDA tensors; on CPU tensors the versions in `cpu_ops.py`
(same results in fewer torch ops) where one exists, else the reference. Tests run the Triton kernels on the CPU
with TRITON_INTERPRET=1 and backend "triton".
"""

from __future__ import annotations

from typing import Any

import torch

from . import activation, cpu_ops, kv_store, norms, paged_attention, rotary
from .cpu_attention import CpuAttentionPlan, cpu_attention_block, cpu_paged_attention, plan_cpu_attention
from .decode_stack import StackProgram
from .rotary import compute_cos_sin_cache

_BACKEND = "auto"
_OPS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
)
_MODULES = {
    "paged_decode_attention": paged_attention,
    "paged_prefill_attention": paged_attention,
    "store_kv": kv_store,
    "rms_norm": norms,
    "add_rms_norm": norms,
    "rotary_embedding": rotary,
    "silu_and_mul": activation,
    "gelu_tanh_and_mul": activation,
}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_backend(name: str) -> None:
    """Select "auto", "torch" or "triton" for every op."""
    global _BACKEND
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel backend must be auto, torch or triton, got {name!r}")
    if name == "triton" and not triton_available():
        raise RuntimeError("kernel backend 'triton' asked for, but triton is not installed")
    _BACKEND = name
    _CACHE.clear()


def backend() -> str:
    return _BACKEND


_CACHE: dict[tuple[str, str], Any] = {}  # (op, device type) -> implementation, for this backend


def _impl(op: str, device: torch.device) -> Any:
    fn = _CACHE.get((op, device.type))
    if fn is None:
        fn = _CACHE[(op, device.type)] = _resolve(op, device)
    return fn


def _resolve(op: str, device: torch.device) -> Any:
    if _BACKEND == "auto" and device.type == "cpu":
        fast = getattr(cpu_ops, op + "_cpu", None)
        if fast is not None:
            return fast
    mod = _MODULES[op]
    want_triton = _BACKEND == "triton" or (_BACKEND == "auto" and device.type == "cuda")
    fn = getattr(mod, op + "_triton", None) if want_triton else None
    if fn is None:
        return getattr(mod, op + "_ref")
    return fn


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, *, window=0, softcap=0.0, sinks=None
):  # type: ignore[no-untyped-def]
    """The attention variant's keywords: paged_attention.py."""
    return _impl("paged_decode_attention", q.device)(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window=window, softcap=softcap, sinks=sinks
    )


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    max_query_len=None,
    *,
    window=0,
    softcap=0.0,
    sinks=None,
):  # type: ignore[no-untyped-def]
    return _impl("paged_prefill_attention", q.device)(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def store_kv(k, v, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
    return _impl("store_kv", k.device)(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x, weight, eps):  # type: ignore[no-untyped-def]
    return _impl("rms_norm", x.device)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):  # type: ignore[no-untyped-def]
    return _impl("add_rms_norm", x.device)(x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos_sin_cache):  # type: ignore[no-untyped-def]
    return _impl("rotary_embedding", q.device)(positions, q, k, cos_sin_cache)


def silu_and_mul(x):  # type: ignore[no-untyped-def]
    return _impl("silu_and_mul", x.device)(x)


def gelu_tanh_and_mul(x):  # type: ignore[no-untyped-def]
    return _impl("gelu_tanh_and_mul", x.device)(x)


__all__ = list(_OPS) + [
    "use_backend",
    "backend",
    "triton_available",
    "compute_cos_sin_cache",
    "CpuAttentionPlan",
    "cpu_attention_block",
    "cpu_paged_attention",
    "plan_cpu_attention",
    "StackProgram",
]
