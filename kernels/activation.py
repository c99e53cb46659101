"""The gated activations over a fused [gate | up] projection: SwiGLU, silu(gate) * up, and GeGLU
(Gemma), gelu(gate) * up with gelu's tanh approximation (HF's gelu_pytorch_tanh)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._lazy import triton_op


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]; HF's act(gate) * up
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def __getattr__(name: str) -> Any:
    # The Triton version is in elementwise.py, imported on first use; see _lazy.py.
    if name in ("silu_and_mul_triton", "gelu_tanh_and_mul_triton"):
        return triton_op(__package__, "elementwise", name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
