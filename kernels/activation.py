"""SwiGLU activation: silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
