"""Linear layers and embeddings over quantized weights (wsllm.kernels.quant).

The weight stays in its blocks as a plain attribute, not a parameter or buffer, so
that `model.to(dtype)` cannot cast its fp16 scales and `to_empty` cannot drop it.
Activations keep the engine's dtype (fp32 or bf16); `qlinear` returns that dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from wsllm.kernels import moe as kmoe
from wsllm.kernels import quant
from wsllm.models.causal_lm import CausalLM
from wsllm.models.gguf_weights import ExpertParts, LinearPart, QuantCheckpoint
from wsllm.models.layers.moe import Experts

log = logging.getLogger(__name__)

# A format's blocks span this many input features (K quants: 256).
_BLOCK = {"q8_0": 32, "q4_0": 32}


class QuantLinear(nn.Module):
    """`y = x @ W.T + b` with W in quantized blocks."""

    def __init__(self, weight: quant.QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.qbias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in] -> [num_tokens, out]
        return quant.qlinear(x, self.qweight, self.qbias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward() as float32, from the kernel's sums (the LM head: logits not rounded to bf16)."""
        return quant.qlinear(x, self.qweight, self.qbias, torch.float32)

    def native_parts(self) -> tuple[list[quant.QuantWeight], torch.Tensor | None]:
        """What the decode stack runs for forward() (kernels/decode_stack.py)."""
        return [self.qweight], self.qbias

    def extra_repr(self) -> str:
        return f"{self.qweight.qtype}, in={self.in_features}, out={self.out_features}"


class SplitLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose parts differ in format: one matmul
    per part, outputs side by side as the fused layer's would be."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.qbias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p.forward(x) for p in self.parts], dim=-1)
        return y if self.qbias is None else y + self.qbias

    def native_parts(self) -> tuple[list[quant.QuantWeight], torch.Tensor | None] | None:
        """What the decode stack runs for forward(): every part quantized without a bias of its
        own; None otherwise (a float part: layer by layer)."""
        ws = [getattr(p, "qweight", None) for p in self.parts]
        if any(w is None for w in ws) or any(getattr(p, "qbias", None) is not None for p in self.parts):
            return None
        return ws, self.qbias  # type: ignore[return-value]


class QuantEmbedding(nn.Module):
    """Token embeddings read from quantized rows (shared with a tied lm_head)."""

    def __init__(self, weight: quant.QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return self.qweight.select_rows(ids).to(self.dtype)


class QuantExpertsModule(nn.Module):
    """A mixture's experts kept in their quantized blocks (kernels/moe.py: QuantExperts): the MoE
    layer runs them natively; `forward` is the torch reference of that pass."""

    def __init__(self, qexperts: kmoe.QuantExperts) -> None:
        super().__init__()
        self.qexperts = qexperts

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        bias: kmoe.ExpertBias | None = None,
        act: kmoe.ExpertAct = kmoe.SILU,
    ) -> torch.Tensor:
        return kmoe.experts_quant_ref(x, ids, weights, self.qexperts, bias, act)

    def extra_repr(self) -> str:
        q = self.qexperts
        return f"{q.num_experts} experts, {q.gate.qtype}/{q.up.qtype}/{q.down.qtype}, I={q.intermediate_size}"


def _experts(ex: ExpertParts, dtype: torch.dtype) -> nn.Module:
    """Quantized experts as they are; experts with a float part all float (Experts)."""
    parts = (ex.gate, ex.up, ex.down)
    if all(isinstance(p, quant.QuantWeight) for p in parts):
        return QuantExpertsModule(kmoe.QuantExperts(ex.num_experts, *parts))  # type: ignore[arg-type]
    g, u, d = (p.dequantize() if isinstance(p, quant.QuantWeight) else p for p in parts)
    e, h = ex.num_experts, g.shape[1]
    i = g.shape[0] // e
    m = Experts(e, h, i).to(dtype)
    with torch.no_grad():
        m.gate_up.copy_(torch.cat([g.reshape(e, i, h), u.reshape(e, i, h)], dim=1))
        m.down.copy_(d.reshape(e, h, i))
    return m


def _linear(part: LinearPart, dtype: torch.dtype, bias: torch.Tensor | None) -> nn.Module:
    if isinstance(part, torch.Tensor):  # a float weight: nn.Linear (oneDNN packs it later)
        lin = nn.Linear(part.shape[1], part.shape[0], bias=bias is not None, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(part)
            if bias is not None:
                lin.bias.copy_(bias)
        return lin
    return QuantLinear(part, bias)


def _module(parts: list[LinearPart], dtype: torch.dtype, bias: torch.Tensor | None) -> nn.Module:
    if len(parts) == 1:
        return _linear(parts[0], dtype, bias)
    return SplitLinear([_linear(p, dtype, None) for p in parts], bias)


def install(model: CausalLM, ckpt: QuantCheckpoint, dtype: torch.dtype) -> None:
    """Put `ckpt` into `model`, built on the meta device: quantized modules in place of
    the linear layers and the embedding, then the float parameters (norms) in `dtype`."""
    for name, parts in ckpt.linears.items():
        bias = ckpt.floats.pop(name + ".bias", None)
        bias = None if bias is None else bias.to(dtype)
        if name == "embed_tokens":
            continue
        model.set_submodule(name, _module(parts, dtype, bias))
    for name, ex in ckpt.experts.items():
        model.set_submodule(name, _experts(ex, dtype))
    emb = ckpt.linears["embed_tokens"][0]
    if isinstance(emb, torch.Tensor):
        model.embed_tokens = nn.Embedding.from_pretrained(emb.to(dtype), freeze=True)
    else:
        model.embed_tokens = QuantEmbedding(emb, dtype)
    if ckpt.tied and isinstance(emb, torch.Tensor):  # one float copy, the embedding's
        model.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        model.lm_head.weight = model.embed_tokens.weight
    elif ckpt.tied:  # one copy of the blocks, read by rows and by the lm_head's matmul
        model.lm_head = _linear(emb, dtype, None)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.device.type != "meta":
            continue
        if name not in ckpt.floats:
            raise KeyError(f"weight missing from the checkpoint: {name}")
        owner, _, attr = name.rpartition(".")
        value = ckpt.floats.pop(name).to(dtype)
        setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
    if ckpt.floats:
        raise KeyError(f"unexpected weights: {sorted(ckpt.floats)[:5]}")


def quantize_model(model: CausalLM, qtype: str) -> dict[str, int]:
    """Quantize a loaded float model's linear layers to `qtype` ("q8_0" | "q4_0") in
    place; the embedding and lm_head (tied or not) become Q8_0, as llama.cpp keeps its
    output layer at a higher precision. A layer whose input width is not a multiple
    of the block stays float. Returns the layers kept per format."""
    fmt = qtype.upper()
    counts: dict[str, int] = {}
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name != "lm_head" and mod.in_features % _BLOCK[qtype] == 0
    ]
    with torch.no_grad():
        for name, mod in targets:
            w = mod.weight.detach().float()
            qw = quant.pack(fmt, quant.quantize(w, fmt), tuple(w.shape))
            bias = None if mod.bias is None else mod.bias.detach()
            model.set_submodule(name, QuantLinear(qw, bias))
            counts[fmt] = counts.get(fmt, 0) + 1
        for name, mod in list(model.named_modules()):
            if isinstance(mod, Experts) and min(mod.gate_up.shape[2], mod.down.shape[2]) % _BLOCK[qtype] == 0:
                model.set_submodule(name, QuantExpertsModule(_quantize_experts(mod, fmt)))
                counts[fmt] = counts.get(fmt, 0) + 3
        emb, head = model.embed_tokens.weight, model.lm_head.weight
        if emb.shape[1] % _BLOCK["q8_0"] == 0:
            qe = _q8(emb)
            model.lm_head = QuantLinear(qe if head is emb else _q8(head))
            model.embed_tokens = QuantEmbedding(qe, emb.dtype)
            counts["Q8_0"] = counts.get("Q8_0", 0) + (1 if head is emb else 2)
    return counts


def _quantize_experts(m: Experts, fmt: str) -> kmoe.QuantExperts:
    e, i2, h = m.gate_up.shape
    gu = m.gate_up.detach().float()
    parts = [
        gu[:, : i2 // 2].reshape(-1, h),
        gu[:, i2 // 2 :].reshape(-1, h),
        m.down.detach().float().reshape(-1, i2 // 2),
    ]
    gate, up, down = (quant.pack(fmt, quant.quantize(w, fmt), tuple(w.shape)) for w in parts)
    return kmoe.QuantExperts(e, gate, up, down)


def _q8(w: torch.Tensor) -> quant.QuantWeight:
    w = w.detach().float()
    return quant.pack("Q8_0", quant.quantize(w, "Q8_0"), tuple(w.shape))
