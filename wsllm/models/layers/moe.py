"""The mixture-of-experts feed-forward, with every routing knob of MoeConfig once: a router (softmax,
sigmoid, or top-k on the logits then a softmax over the k; its own bias; a selection-only bias;
renormalized and scaled weights), E experts of which each row runs its top k (SwiGLU, or gpt-oss's
clamped SwiGLU; with or without biases on their projections), and a shared expert on every row
(with or without a sigmoid gate).

Float experts run as transformers runs them (kernels/moe.py: experts_float). Quantized experts
(`QuantExpertsModule`, installed by quant_linear.install) run on the CPU in one native call that
routes, runs the grouped pass and the shared expert (kernels/moe.py: MoeNative): the Python layer
and the decode stack make the same call, so the same bits. The experts' biases belong to the MoE
layer (`gate_up_bias`, `down_bias`), not to its experts module, so that float and quantized
experts read the same ones."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wsllm import kernels
from wsllm.kernels import moe as kmoe
from wsllm.models.config import ModelConfig
from wsllm.models.layers.mlp import MLP


class Router(nn.Module):
    """x [T, H] -> logits [T, E] (not an nn.Linear: the CPU's oneDNN packing leaves its float
    weight for the native pass to read). `bias`: the logits' own (gpt-oss);
    `e_score_correction_bias`: the selection-only bias."""

    def __init__(
        self, hidden_size: int, num_experts: int, selection_bias: bool = False, bias: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if selection_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Experts(nn.Module):
    """E float experts: gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and
    down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        bias: kmoe.ExpertBias | None = None,
        act: kmoe.ExpertAct = kmoe.SILU,
    ) -> torch.Tensor:
        return kmoe.experts(x, ids, weights, self.gate_up, self.down, bias, act)


class MoE(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        m = c.moe
        assert m is not None
        self.layer = layer
        self.routing = kmoe.Routing(m.top_k, m.gating, m.renormalize, m.routed_scale)
        self.act = kmoe.ExpertAct(m.activation, m.swiglu_alpha, m.swiglu_limit)
        self.gate = Router(c.hidden_size, m.num_experts, m.selection_bias, m.router_bias)
        self.experts: nn.Module = Experts(m.num_experts, c.hidden_size, m.intermediate_size)
        e, i = m.num_experts, m.intermediate_size
        self.gate_up_bias = nn.Parameter(torch.zeros(e, 2 * i)) if m.expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, c.hidden_size)) if m.expert_bias else None
        self.shared_expert = (
            MLP(c.hidden_size, m.shared_intermediate_size, layer, adapted=False)
            if m.shared_intermediate_size
            else None
        )
        self.shared_expert_gate = Router(c.hidden_size, 1) if m.shared_gate else None
        self._native: Any = None  # kmoe.MoeNative once built; False where it cannot be

    def expert_bias(self) -> kmoe.ExpertBias | None:
        if self.gate_up_bias is None or self.down_bias is None:
            return None
        return kmoe.ExpertBias(self.gate_up_bias, self.down_bias)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:  # [T, H] -> [T, H]
        native = self.native() if x.device.type == "cpu" else None
        if native is not None:
            return native.forward(x)
        weights, ids = kmoe.route(self.gate.forward(x), self.routing, self.gate.e_score_correction_bias)
        y = self.experts.forward(x, ids, weights, self.expert_bias(), self.act)
        if self.shared_expert is not None:
            s = self.shared_expert.forward(x)
            if self.shared_expert_gate is not None:
                s = s * torch.sigmoid(self.shared_expert_gate.forward(x))
            y = y + s
        return y

    def native(self) -> kmoe.MoeNative | None:
        """The native layer over quantized experts (built once); None for float experts, a
        shared expert over float weights, or without the native build."""
        if self._native is None:
            self._native = self._build_native() or False
        return self._native or None

    def _build_native(self) -> kmoe.MoeNative | None:
        qe = getattr(self.experts, "qexperts", None)
        if qe is None:
            return None
        shared: list[Any] = []
        if self.shared_expert is not None:
            for proj in (self.shared_expert.gate_up_proj, self.shared_expert.down_proj):
                found = proj.native_parts() if hasattr(proj, "native_parts") else None
                if found is None or found[1] is not None:
                    return None
                shared.append(found[0])
        sel = self.gate.e_score_correction_bias
        gate = None if self.shared_expert_gate is None else self.shared_expert_gate.weight.reshape(-1)
        return kmoe.MoeNative.build(
            self.gate.weight,
            sel,
            qe,
            self.routing,
            shared,
            gate,
            self.gate.bias,
            self.expert_bias(),
            self.act,
        )

    def native_ops(self, prog: kernels.StackProgram) -> bool:
        """The decode stack's form of `forward`: the same native call."""
        native = self.native()
        if native is None:
            return False
        prog.moe(native)
        return True
