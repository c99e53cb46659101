"""The dense feed-forward over a fused gate/up projection: down(act(gate) * up), SwiGLU (silu) or
GeGLU (gelu, tanh approximation: Gemma); ModelConfig.hidden_act."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wsllm import kernels
from wsllm.models.layers.attention import lora_key

#: LoRA slots of a layer (kernels/lora.py: SLOTS): the MLP's two projections
GATE_UP_SLOT, DOWN_SLOT = 2, 3


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        layer: int = 0,
        adapted: bool = True,
        activation: str = "silu",  # config.ACTIVATIONS
    ) -> None:
        super().__init__()
        self.layer = layer
        self.adapted = adapted  # LoRA adapters may target it (a shared expert's MLP: never)
        self.activation = activation
        self._act = kernels.silu_and_mul if activation == "silu" else kernels.gelu_tanh_and_mul
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if lora is None or not self.adapted:
            return self.down_proj.forward(self._act(self.gate_up_proj.forward(x)))
        gate_up = self.gate_up_proj.forward(x)
        lora.apply(self.layer, GATE_UP_SLOT, x, gate_up)
        h = self._act(gate_up)
        y = self.down_proj.forward(h)
        lora.apply(self.layer, DOWN_SLOT, h, y)
        return y

    def native_ops(self, prog: kernels.StackProgram) -> bool:
        """The decode stack's form of `forward`."""
        keys = (
            (lora_key(self.layer, GATE_UP_SLOT), lora_key(self.layer, DOWN_SLOT))
            if self.adapted
            else (-1, -1)
        )
        if not prog.linear(self.gate_up_proj, keys[0]):
            return False
        if self.activation == "silu":
            prog.silu_mul()
        else:
            prog.gelu_mul()
        return prog.linear(self.down_proj, keys[1])
