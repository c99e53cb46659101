"""RMSNorm, plain or fused with the residual add (kernels.rms_norm, kernels.add_rms_norm). Gemma's
(1 + w) is this norm over a weight that holds the 1 (ModelConfig.norm_offset, folded at load)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wsllm import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def native_ops(self, prog: kernels.StackProgram, residual: bool = True) -> bool:
        """The decode stack's form of `forward(x, residual)` (`residual` False: of `forward(x)`)."""
        return prog.norm(self.weight, self.eps) if residual else prog.rms_norm(self.weight, self.eps)
