"""What a GGUF holds, under the model's own names, before any weight is read (`plan`): llama.cpp's
tensor names mapped onto the shared layers' modules, each linear part a `Source` read when it is
written (gguf_weights.py repacks them), norms, biases and routers read now as fp32.

Linear weights in a format the quantized kernels run (`quant.QTYPES`) stay in their blocks;
everything else (F16/F32 tensors, formats without a kernel) becomes fp32. llama.cpp stores the
rows of Q and K permuted for its rotary layout (pairs (i, i + d/2) interleaved as (2i, 2i + 1)) for
the architectures whose Family says so; that permutation moves whole rows, so it is undone on the
raw rows of blocks, exactly as transformers' GGUF loader undoes it on de-quantized values.

Phi-3's fused `attn_qkv` is the whole qkv_proj and its `ffn_up` (no `ffn_gate`) the whole
gate_up_proj; under partial rotary q's and k's rows are reordered as the HF loader reorders them
(wsllm/models/rope.py). Gemma's sandwich norms are `post_attention_norm` and `post_ffw_norm` (its
`ffn_norm` is the norm before the feed-forward, as a Llama's).

Experts: the 3-D `ffn_{gate,up,down}_exps` ([E, rows, cols], each expert's rows one after another)
are one Source each; a fused `ffn_gate_up_exps` is two, each expert's first half of rows (gate) and
second half (up). The shared expert's `*_shexp` are a dense MLP's parts; `ffn_gate_inp` (the
router), `ffn_gate_inp_shexp` (the shared expert's gate) and `exp_probs_b` (the selection bias) are
fp32 parameters. gpt-oss: `post_attention_norm` is its ffn_norm, `attn_sinks` the sinks, and
the biases of the router and of each expert's gate, up and down (`ffn_*_exps.bias`, [E, rows])
become the MoE layer's `gate.bias`, `gate_up_bias` (gate's then up's per expert) and `down_bias`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsllm.kernels import quant
from wsllm.models import registry
from wsllm.models.config import ModelConfig
from wsllm.models.gguf_checks import GGUFError, check_tensors
from wsllm.models.rope import qkv_row_order

# GGUF tensor (in a block) -> (the model's module, which part of it in row order)
_LAYER_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_qkv": ("self_attn.qkv_proj", 0),  # Phi-3's, fused in the file
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),  # without an ffn_gate (Phi-3): gate|up fused, all of it
    "ffn_down": ("mlp.down_proj", 0),
    "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0),
    "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", 0),
}
# gpt-oss's post_attention_norm is the norm before the feed-forward (its file has no ffn_norm)
_PRE_FFN_NORM = "post_attention_layernorm"
_LAYER_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attn_post_norm",  # Gemma's sandwich norms (gpt-oss's: _PRE_FFN_NORM)
    "post_ffw_norm": "ffn_post_norm",
}
# fp32 parameters by their whole name in the layer (the router's, the shared gate's, the bias)
_LAYER_FLOATS = {
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    "attn_sinks": "self_attn.sinks",
}
# biases of a layer's router and experts (gpt-oss): (parameter, part); the gate's and up's [E, I]
# become each expert's row of gate_up_bias [E, 2I], gate's values then up's
_LAYER_BIASES = {
    "ffn_gate_inp": ("mlp.gate.bias", 0),
    "ffn_gate_exps": ("mlp.gate_up_bias", 0),
    "ffn_up_exps": ("mlp.gate_up_bias", 1),
    "ffn_down_exps": ("mlp.down_bias", 0),
}
_LAYER_EXPERTS = {
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_down_exps": "down",
    "ffn_gate_up_exps": "gate_up",
}
_GLOBAL = {"token_embd": ("embed_tokens", 0), "output": ("lm_head", 0)}
# llama3's rotary factors, Phi-3's LongRoPE ones: read into the config (or computed from it) instead
_SKIPPED = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (any trailing shape: values or
    raw block bytes): per head, rows [d/2, 2] -> [2, d/2]."""
    n = rows.shape[0]
    half = n // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _target(name: str, sandwich: bool = False) -> tuple[str, Any, str] | None:
    """GGUF tensor name -> (module or parameter, part, kind): kind "weight" | "bias" (a linear's
    part), "norm" | "float" (an fp32 parameter), "experts" (part: gate, up, down or gate_up).
    `sandwich`: the model norms each branch's output (Gemma's post_attention_norm is that norm;
    without them it is gpt-oss's norm before the feed-forward)."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3:
        layer, what = parts[1], parts[2]
        if kind == "bias" and what in _LAYER_BIASES:
            param, i = _LAYER_BIASES[what]
            return f"layers.{layer}.{param}", i, "expert_bias"
        if what in _LAYER_LINEARS:
            mod, i = _LAYER_LINEARS[what]
            return f"layers.{layer}.{mod}", i, kind
        if what == "post_attention_norm" and not sandwich:
            return f"layers.{layer}.{_PRE_FFN_NORM}.{kind}", 0, "norm"
        if what in _LAYER_NORMS:
            return f"layers.{layer}.{_LAYER_NORMS[what]}.{kind}", 0, "norm"
        if what in _LAYER_FLOATS:
            return f"layers.{layer}.{_LAYER_FLOATS[what]}", 0, "float"
        if what in _LAYER_EXPERTS:
            return f"layers.{layer}.mlp.experts", _LAYER_EXPERTS[what], "experts"
    elif base in _GLOBAL:
        mod, i = _GLOBAL[base]
        return mod, i, kind
    elif base == "output_norm":
        return "norm.weight", 0, "norm"
    if base in _SKIPPED:
        return None
    raise KeyError(f"unexpected GGUF tensor {name!r}")


def as_float(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import quants

    return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


@dataclass(slots=True)
class Source:
    """One GGUF tensor that becomes (part of) a linear weight or an experts' projection; read when
    written."""

    qtype: str  # a kernel format kept as it is, or "F32" (de-quantized)
    tensor: Any  # gguf's ReaderTensor: a view of the memory-mapped file
    shape: tuple[int, int]  # [rows, in_features] (experts: E * each expert's rows)
    n_head: int | None  # un-permute Q/K rows over this many heads
    name: str = ""  # its name in the file, for an error
    experts: int = 0  # > 0: a fused gate_up of this many experts, of which `half` is taken
    half: int = 0
    row_order: torch.Tensor | None = None  # its rows reordered so (partial rotary: models/rope.py)

    def rows(self) -> np.ndarray:
        """[rows, bytes] of blocks (a view of the map unless un-permuted or halved) or fp32 [rows, cols]."""
        full = (self.shape[0] * (2 if self.experts else 1), self.shape[1])
        if self.qtype == "F32":
            raw = as_float(self.tensor, full)
        else:
            raw = np.asarray(self.tensor.data).reshape(full[0], -1)
        if self.experts:  # each expert's gate rows, then its up rows: take one half of each
            raw = raw.reshape(self.experts, 2, -1, raw.shape[-1])[:, self.half].reshape(self.shape[0], -1)
        raw = raw if self.n_head is None else unpermute_rows(raw, self.n_head)
        return raw if self.row_order is None else raw[self.row_order.numpy()]


@dataclass(slots=True)
class Plan:
    """What a GGUF holds, before any weight is read: linear parts per module, each experts module's
    projections, norms, biases and other fp32 parameters (small: read now), kernel formats counted."""

    linears: dict[str, dict[int, Source]] = field(default_factory=dict)
    experts: dict[str, dict[str, Source]] = field(default_factory=dict)  # module -> gate, up, down
    num_experts: dict[str, int] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first


def plan(path: Path, reader: Any, cfg: ModelConfig, dequantize: bool = False) -> Plan:
    """What `path` holds, its shapes checked against `cfg` first; GGUFError naming the tensor.
    `dequantize`: every linear part fp32 (the float model)."""
    check_tensors(
        path, ((t.name, shape_of(t), int(t.data.nbytes), int(t.n_bytes)) for t in reader.tensors), cfg
    )
    try:
        return _plan_checked(reader, cfg, dequantize)
    except GGUFError:
        raise
    except Exception as e:
        raise GGUFError(path, getattr(e, "tensor", "?"), str(e)) from e


def _plan_checked(reader: Any, cfg: ModelConfig, dequantize: bool) -> Plan:
    arch_field = reader.fields.get("general.architecture")
    experts = cfg.moe is not None
    permuted = arch_field is not None and registry.for_gguf(arch_field.contents(), experts).gguf_permuted_qk
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    orders = _row_orders(cfg)
    out = Plan()
    biases: dict[str, dict[int, np.ndarray]] = {}
    expert_biases: dict[str, dict[int, np.ndarray]] = {}  # joined on their last axis
    for t in reader.tensors:
        target = _target(t.name, cfg.sandwich_norms)
        if target is None:
            continue
        mod, idx, kind = target
        shape = shape_of(t)
        what = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        n_head = heads.get(what) if permuted else None
        if kind in ("norm", "bias", "float", "expert_bias"):
            v = read(t, lambda t=t, shape=shape: as_float(t, shape))
            v = v if n_head is None else unpermute_rows(v, n_head)
            v = v if kind != "bias" or what not in orders else v[orders[what].numpy()]
            if kind == "bias":
                biases.setdefault(mod, {})[idx] = v
            elif kind == "expert_bias":
                expert_biases.setdefault(mod, {})[idx] = v
            else:  # the shared gate is [H] in the file, a [1, H] router here
                out.floats[mod] = torch.from_numpy(
                    v.reshape(1, -1) if what == "ffn_gate_inp_shexp" else v.copy()
                )
            continue
        qtype = _kept(t, out, dequantize)
        if kind == "experts":
            _plan_experts(out, mod, idx, t, qtype, shape)
        else:
            source = Source(qtype, t, (shape[0], shape[1]), n_head, t.name, row_order=orders.get(what))
            out.linears.setdefault(mod, {})[idx] = source
    for mod, bs in biases.items():
        out.floats[mod + ".bias"] = torch.from_numpy(np.concatenate([bs[i] for i in sorted(bs)]))
    for mod, bs in expert_biases.items():
        out.floats[mod] = torch.from_numpy(np.concatenate([bs[i] for i in sorted(bs)], axis=-1))
    return out


def _row_orders(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Each q/k tensor's row order under partial rotary (wsllm/models/rope.py), by its GGUF name."""
    order = qkv_row_order(cfg)
    if order is None:
        return {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"attn_qkv": order, "attn_q": order[:q], "attn_k": order[q : q + kv] - q}


def _kept(t: Any, out: Plan, dequantize: bool) -> str:
    """The format a linear tensor is kept in (counted), or "F32"."""
    qtype = t.tensor_type.name
    if qtype in quant.QTYPES and not dequantize:
        out.counts[qtype] = out.counts.get(qtype, 0) + 1
        return qtype
    return "F32"  # a float tensor, a format without a kernel, or the float model


def _plan_experts(out: Plan, mod: str, which: str, t: Any, qtype: str, shape: tuple[int, ...]) -> None:
    e, rows, cols = shape
    out.num_experts[mod] = e
    parts = out.experts.setdefault(mod, {})
    if which == "gate_up":  # each expert's rows: its gate's, then its up's
        for half, name in enumerate(("gate", "up")):
            parts[name] = Source(qtype, t, (e * rows // 2, cols), None, t.name, experts=e, half=half)
    else:
        parts[which] = Source(qtype, t, (e * rows, cols), None, t.name)


def read(t: Any, fn: Any) -> Any:
    try:  # an error tagged with the tensor's name, for the GGUFError
        return fn()
    except Exception as e:
        e.tensor = t.name  # type: ignore[attr-defined]
        raise
