"""The mixture-of-experts feed-forward's kernels: routing (every knob of models/config.py's
MoeConfig, once) and the experts' pass, each beside its torch reference.

    weights, ids = route(logits, routing)          # [T, k] float32, [T, k] int64, ascending ids per row
    y = experts_float(x, ids, weights, gate_up, down)   # float experts [E, 2I, H], [E, H, I] (HF's loop)
    (each pass takes the experts' biases, `ExpertBias`, and their activation, `ExpertAct`: SwiGLU by
    default, or gpt-oss's clamped SwiGLU)
    y = moe_experts_triton(...)                    # the same on Triton (kernels/moe_triton.py): CUDA
    y = experts_quant_ref(x, ids, weights, qe)     # quantized experts, the native pass's arithmetic in torch
    native: `MoeNative` over kernels/cpu/moe.cpp (router, routing, the grouped pass and the shared
    expert in one call), `grouped_experts_cpu` the grouped pass alone with a given routing (tests)

The native pass (kernels/cpu/moe.cpp): the step's (row, expert) pairs counting-sorted by expert, each
chosen expert run once over all of its rows on its quantized blocks (gate and up together, SiLU·up in
float32 as the tiles come out), x quantized once for gate/up and each pair's hidden row once for down,
the routing weight folded into down's output, and each row's k outputs summed in the order of its own
(ascending) expert ids: a row's bits do not depend on its batch or on the other rows' experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import quant
from .cpu_ops import native_ext, native_isa
from .quant_ref import qlinear_parts

#: MoeConfig.gating's numbering on the native side (kernels/cpu/moe.h: Gating)
GATINGS = ("softmax", "sigmoid", "softmax_topk")
#: MoeConfig.activation's numbering on the native side (kernels/cpu/moe.h: ExpertActKind)
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(slots=True, frozen=True)
class ExpertAct:
    """The experts' activation of (gate, up), float32: "silu": silu(gate) * up; "swiglu_oai"
    (gpt-oss): g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


SILU = ExpertAct()


@dataclass(slots=True)
class ExpertBias:
    """The experts' biases (gpt-oss): gate_up [E, 2I] (each expert's gate's, then its up's) and
    down [E, H], added to each projection's output before the activation and the routing weight."""

    gate_up: torch.Tensor
    down: torch.Tensor

    def gate_up_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = self.gate_up[e].float().chunk(2)
        return g, u


@dataclass(slots=True, frozen=True)
class Routing:
    """The router's knobs (models/config.py: MoeConfig)."""

    top_k: int
    gating: str = "softmax"
    renormalize: bool = False
    scale: float = 1.0


def route(
    logits: torch.Tensor, r: Routing, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), each row's ids ascending.

    softmax / sigmoid: scores of every expert, the top k by score + selection bias (the bias
    chooses, never weighs), their scores as weights; softmax_topk: the top k logits, then a softmax
    over those k. Then divided by their sum when renormalizing, times the scale."""
    logits = logits.float()
    if r.gating == "softmax_topk":
        top, ids = logits.topk(r.top_k, dim=-1)
        w = torch.softmax(top, dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1) if r.gating == "softmax" else torch.sigmoid(logits)
        choose = scores if selection_bias is None else scores + selection_bias.float()
        _, ids = choose.topk(r.top_k, dim=-1)
        w = scores.gather(1, ids)
    if r.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if r.scale != 1.0:
        w = w * r.scale
    ids, order = ids.sort(dim=-1)
    return w.gather(1, order), ids


def experts_float(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k]
    weights: torch.Tensor,  # [T, k] float32
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor,  # [E, H, I]
    bias: ExpertBias | None = None,
    act: ExpertAct = SILU,
) -> torch.Tensor:  # [T, H] in x's dtype
    """Float experts, as transformers runs them: each expert that some row chose, over its rows,
    its output (biases added) times the routing weight added in order of expert id."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        gu = F.linear(x[rows], gate_up[e], None if bias is None else bias.gate_up[e])
        g, u = gu.chunk(2, dim=-1)
        y = F.linear(act(g, u), down[e], None if bias is None else bias.down[e])
        out.index_add_(0, rows, y * weights[rows, slot, None].to(x.dtype))
    return out


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    bias: ExpertBias | None = None,
    act: ExpertAct = SILU,
) -> torch.Tensor:
    """The float experts' pass on the backend `kernels.use_backend` picks: Triton on CUDA ("auto")
    or everywhere ("triton"; with no host sync, so a decode step replays in a CUDA graph), else
    the torch loop."""
    from . import backend

    kind = backend()
    if kind == "triton" or (kind == "auto" and x.device.type == "cuda"):
        from .moe_triton import moe_experts_triton  # triton imported only here

        return moe_experts_triton(x, ids, weights, gate_up, down, bias=bias, act=act)
    return experts_float(x, ids, weights, gate_up, down, bias, act)


@dataclass(slots=True)
class QuantExperts:
    """E experts in their quantized blocks: gate and up [E * I, H], down [E * H, I], each one
    QuantWeight whose rows are the experts' rows one expert after another (each expert's rows
    begin a group of the packed layout: I and H are multiples of its 16 rows)."""

    num_experts: int
    gate: quant.QuantWeight
    up: quant.QuantWeight
    down: quant.QuantWeight

    def __post_init__(self) -> None:
        e = self.num_experts
        i, h = self.gate.out_features // e, self.gate.in_features
        if (
            self.gate.out_features != e * i
            or (self.up.out_features, self.up.in_features) != (e * i, h)
            or (self.down.out_features, self.down.in_features) != (e * h, i)
        ):
            raise ValueError(
                f"expert weights of {e} experts do not agree: {self.gate}, {self.up}, {self.down}"
            )
        if i % quant.ROWS or h % quant.ROWS:
            raise ValueError(f"quantized experts need widths of a multiple of {quant.ROWS} (I={i}, H={h})")

    @property
    def intermediate_size(self) -> int:
        return self.gate.out_features // self.num_experts

    @property
    def hidden_size(self) -> int:
        return self.gate.in_features

    def expert(self, which: str, e: int) -> quant.QuantWeight:
        """Expert e's own rows of `which` ("gate", "up", "down") as a QuantWeight (a view)."""
        w: quant.QuantWeight = getattr(self, which)
        rows = w.out_features // self.num_experts
        g = rows // quant.ROWS
        return quant.QuantWeight(w.qtype, (rows, w.in_features), w.packed[e * g : (e + 1) * g])

    def nbytes(self) -> int:
        return self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()


def experts_quant_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    qe: QuantExperts,
    bias: ExpertBias | None = None,
    act: ExpertAct = SILU,
) -> torch.Tensor:
    """The native grouped pass's arithmetic in plain torch (kernels/quant_ref.py per expert): per
    (row, expert) gate and up in float32 from x's int8 blocks (plus their biases), the activation
    in float32, down over that row's int8 blocks (plus its bias), times the weight; a row's outputs
    summed in its ids' order, the result rounded to x's dtype. The oracle of the native pass (its
    exp and sums may differ in the last bits) and its path without the native build."""
    xf = x.float() if x.dtype not in (torch.float32, torch.bfloat16) else x
    ys = torch.zeros(*ids.shape, qe.hidden_size, dtype=torch.float32)  # [T, k, H]: each pair's output
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)  # each row computed alone in the arithmetic: batched here
        gate, up, down = (_parts(qe.expert(w, e)) for w in ("gate", "up", "down"))
        g = qlinear_parts(qe.gate.qtype, xf[rows], gate, None, torch.float32)
        u = qlinear_parts(qe.up.qtype, xf[rows], up, None, torch.float32)
        if bias is not None:
            bg, bu = bias.gate_up_of(e)
            g, u = g + bg, u + bu
        y = qlinear_parts(qe.down.qtype, act(g, u), down, None, torch.float32)
        if bias is not None:
            y = y + bias.down[e].float()
        ys[rows, slot] = y * weights[rows, slot, None]
    out = ys[:, 0].clone()
    for j in range(1, ids.shape[1]):  # in the order of each row's ids
        out = out + ys[:, j]
    return out.to(x.dtype)


def _parts(w: quant.QuantWeight) -> Any:
    from .quant_formats import block_parts, packed_fields

    f = packed_fields(w.qtype, w.packed)
    return block_parts(w.qtype, {name: t[: w.out_features] for name, t in f.items()})


class MoeNative:
    """One MoE layer over quantized experts, on the native kernels (kernels/cpu/moe_layer.h:
    MoeLayer): router, routing, the grouped pass and the shared expert in one call."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    @classmethod
    def build(
        cls,
        router: torch.Tensor,  # [E, H]
        selection_bias: torch.Tensor | None,  # [E]
        qe: QuantExperts,
        routing: Routing,
        shared: list[list[quant.QuantWeight]],  # the shared expert's gate_up parts, then its down parts
        shared_gate: torch.Tensor | None,  # [H]
        router_bias: torch.Tensor | None = None,  # [E]: added to the logits
        bias: ExpertBias | None = None,
        act: ExpertAct = SILU,
    ) -> MoeNative | None:
        ext = native_ext()
        if ext is None:
            return None
        qid = quant.QTYPES.index
        parts = [w for p in shared for w in p]
        empty = torch.empty(0)

        def f32(t: torch.Tensor | None) -> torch.Tensor:
            return empty if t is None else t.detach().float().contiguous().reshape(-1)

        biases = [f32(router_bias), empty, empty, empty]  # the router's, gate's, up's, down's
        if bias is not None:
            gate_up = bias.gate_up.detach().float().reshape(qe.num_experts, 2, -1)
            biases[1:] = [f32(gate_up[:, 0]), f32(gate_up[:, 1]), f32(bias.down)]
        handle = ext.MoeLayer(
            router.detach().float().contiguous(),
            empty if selection_bias is None else selection_bias.detach().float().contiguous(),
            [qe.gate.packed, qe.up.packed, qe.down.packed],
            [qid(qe.gate.qtype), qid(qe.up.qtype), qid(qe.down.qtype)],
            routing.top_k,
            GATINGS.index(routing.gating),
            routing.renormalize,
            routing.scale,
            [w.packed for w in parts],
            [qid(w.qtype) for w in parts],
            [w.out_features for w in parts],
            len(shared[0]) if shared else 0,
            empty if shared_gate is None else shared_gate.detach().float().contiguous(),
            biases,
            ACTIVATIONS.index(act.kind),
            act.alpha,
            act.limit,
        )
        return cls(handle)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] float32 / bfloat16 -> [T, H] in x's dtype
        return self.handle.forward(x.contiguous(), native_isa())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [T, k], weights float32 [T, k]): what the native router chooses."""
        ids, w = self.handle.route(x.contiguous(), native_isa())
        return ids, w

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped pass alone over a given routing -> float32 [T, H] (the routed sum)."""
        return self.handle.experts(
            x.contiguous(), ids.to(torch.int32).contiguous(), weights.float().contiguous(), native_isa()
        )
