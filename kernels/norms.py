"""RMSNorm, plain and fused with the residual add."""

from __future__ import annotations

from typing import Any

import torch

from ._lazy import triton_op


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; computed in fp32 as HF does, cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def __getattr__(name: str) -> Any:
    # The Triton version is in elementwise.py, imported on first use; see _lazy.py.
    if name in ("rms_norm_triton", "add_rms_norm_triton"):
        return triton_op(__package__, "elementwise", name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
