"""A model's shape and the knobs that tell one family from another, read once when the layers are
built: `ModelConfig` (and `MoeConfig` for the mixture-of-experts layer). A family file reads its HF
config into these fields (`hf_base` reads the fields every family spells the same way); no layer
asks which family it belongs to.

A new knob is a field here with the default that leaves every other family as it was, read where
the layer is built (`Attention`, `DecoderLayer`, `MoE`); per-layer differences (a layer that is
dense in a mixture of experts; later windows or rotary bases) are answered by `ModelConfig.layer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the feed-forward activations the layers run ("silu": SwiGLU, silu(gate) * up; "gelu_tanh":
#: GeGLU, gelu(gate) * up with gelu's tanh approximation, HF's gelu_pytorch_tanh: Gemma)
ACTIVATIONS = ("silu", "gelu_tanh")
#: the experts' activations (MoeConfig.activation): "swiglu_oai" is gpt-oss's clamped SwiGLU,
#: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")
#: a layer's rotary table (LayerSpec.rope): the model's own; the sliding layers' own base
#: (Gemma 3's rope_local_base_freq); none (a NoPE layer: SmolLM3's every fourth)
ROPES = ("global", "local", "none")
#: how a router turns its logits into the chosen experts' weights (MoeConfig.gating)
GATINGS = ("softmax", "sigmoid", "softmax_topk")
#: QK-norm (ModelConfig.qk_norm): none; "head": RMSNorm over head_dim on each head of q and k
#: (Qwen3); "full": over the whole width of q and of k (OLMoE)
QK_NORMS = ("none", "head", "full")


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """A mixture-of-experts feed-forward: every routing knob of llama.cpp's build_moe_ffn, once.

    Per row: logits = x . router^T [E] (+ router bias); scores = softmax or sigmoid of them
    ("softmax_topk": the logits themselves); the top_k experts by score (+ the selection bias,
    which chooses but never weighs); their weights are the scores (softmax_topk: a softmax over
    the k chosen logits), divided by their sum when `renormalize`, times `routed_scale`. The
    output is sum_j weight_j * expert_j(x), plus a shared expert on every row (times
    sigmoid(x . shared_gate) when it has a gate). `router_bias`: the logits have a bias (it
    chooses and weighs); `expert_bias`: each expert's gate, up and down have one (gpt-oss)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    gating: str = "softmax"  # GATINGS
    renormalize: bool = False  # the k chosen weights divided by their sum (HF: norm_topk_prob)
    routed_scale: float = 1.0  # the chosen weights times this (DeepSeek's routed_scaling_factor)
    selection_bias: bool = False  # a per-expert bias added to the scores to choose, not to weigh
    shared_intermediate_size: int = 0  # a shared expert run on every row (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(x . w) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (leading dense, mlp_only_layers)
    activation: str = "silu"  # the experts' (EXPERT_ACTIVATIONS)
    router_bias: bool = False  # logits = x . router^T + bias (gpt-oss)
    expert_bias: bool = False  # biases on each expert's gate, up and down (gpt-oss)
    swiglu_alpha: float = 1.702  # "swiglu_oai": the sigmoid's gain
    swiglu_limit: float = 7.0  # "swiglu_oai": the clamp of gate (above) and up (both sides)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"a mixture of {self.num_experts} experts cannot choose {self.top_k} of them a token"
            )
        if self.gating not in GATINGS:
            raise ValueError(f"expert gating {self.gating!r} is not supported (one of {', '.join(GATINGS)})")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r} is not supported")


@dataclass(slots=True, frozen=True)
class LayerSpec:
    """What one layer is, where layers differ (ModelConfig.layer)."""

    moe: bool  # its feed-forward is the mixture of experts (else the dense MLP)
    window: int = 0  # sliding window in tokens (kernels/paged_attention.py), 0: full attention
    softcap: float = 0.0  # attention logits soft-capped at this (Gemma 2), 0: off
    sinks: bool = False  # a learned per-head logit in the softmax's denominator (gpt-oss)
    rope: str = "global"  # its rotary table (ROPES; wsllm/models/rope.py)


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False  # the attention's output projection has a bias (gpt-oss)
    family: str = "llama"  # the registry's name for it (wsllm/models/registry.py): logs and errors only
    pooling: str = "last"  # EngineConfig.pooling "auto": how an embedding request pools its hidden states
    qk_norm: str = "none"  # QK_NORMS
    attention_scale: float | None = (
        None  # q.k's scale (None: head_dim ** -0.5; Granite's attention_multiplier)
    )
    embedding_multiplier: float = 1.0  # the embeddings times this (Granite)
    residual_multiplier: float = 1.0  # each branch's output times this before the residual add (Granite)
    logits_scaling: float = 1.0  # the logits divided by this (Granite)
    hidden_act: str = "silu"  # the dense MLP's (ACTIVATIONS)
    moe: MoeConfig | None = None
    sliding_window: int = 0  # the windowed layers' window in tokens (0: none)
    layer_types: tuple[str, ...] = ()  # HF's per layer "sliding_attention" | "full_attention"; () all alike
    attn_softcap: float = 0.0  # every layer's attention logit soft-cap (0: off)
    attn_sinks: bool = False  # every layer has attention sinks
    # -- the dense families of Gemma 2/3, Phi-3, SmolLM3 (docs/models.md), each off by default --
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's 1 (folded into w as HF weights load)
    sandwich_norms: bool = False  # a norm on the attention's and the feed-forward's outputs too (Gemma 2/3)
    final_softcap: float = 0.0  # the logits soft-capped at this, c * tanh(l / c) (Gemma 2), 0: off
    rope_local_theta: float = 0.0  # the sliding layers' rotary base, unscaled (Gemma 3); 0: rope_theta's
    nope_layers: tuple[int, ...] = ()  # layers without rotary (SmolLM3)
    partial_rotary_factor: float = 1.0  # rotary on this fraction of each head (Phi-4-mini's 0.75)
    extra: dict[str, Any] = field(default_factory=dict)  # what a family keeps for itself (not read by layers)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported (only {', '.join(ACTIVATIONS)})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                "is not an even rotary width"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} attention heads do not group into {self.num_kv_heads} KV heads"
            )

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that rotary turns (HF: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def scale(self) -> float:
        """q.k's scale."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def layer(self, i: int) -> LayerSpec:
        """Layer i's own shape."""
        moe = self.moe is not None and i not in self.moe.dense_layers
        windowed = not self.layer_types or self.layer_types[i] == "sliding_attention"
        window = self.sliding_window if windowed else 0
        local = bool(self.rope_local_theta) and bool(self.layer_types) and windowed
        rope = "none" if i in self.nope_layers else "local" if local else "global"
        return LayerSpec(moe=moe, window=window, softcap=self.attn_softcap, sinks=self.attn_sinks, rope=rope)

    def windows(self) -> tuple[int, ...]:
        """The layers' distinct attention windows, ascending (0, full attention, first): a KV
        group each, numbered in this order (engine/kv_groups.py)."""
        return tuple(sorted({self.layer(i).window for i in range(self.num_layers)}))


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling or None) from an HF config: transformers 4's `rope_theta` and
    `rope_scaling`, or 5's `rope_parameters`."""
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    return float(theta), scaling


def hf_base(cfg: dict[str, Any], family: str, **knobs: Any) -> ModelConfig:
    """The fields every family's HF config spells the same way, and the family's `knobs`
    (ModelConfig's other fields) on top. Refuses what no layer here runs."""
    theta, scaling = hf_rope(cfg)
    window, layer_types = hf_window(cfg)
    heads = cfg["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size") or 0,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        family=family,
        hidden_act=_activation(cfg.get("hidden_act", "silu")),
        sliding_window=window,
        layer_types=layer_types,
    )
    fields.update(knobs)
    return ModelConfig(**fields)


def hf_window(cfg: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """(sliding window, layer types) from an HF config, as transformers reads them: Mistral's
    `sliding_window` on every layer (null: none); Qwen2/3's only with `use_sliding_window`, on
    the layers `layer_types` names "sliding_attention" (transformers 5 writes them; else the
    layers from `max_window_layers` on). A query at p sees p - W + 1 .. p (transformers'
    sliding_window_overlay: kv_idx > q_idx - W), as kernels/paged_attention.py's `window`."""
    window = int(cfg.get("sliding_window") or 0)
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = 0  # Qwen's switch, off in every released model (their sliding_window is unused)
    if window <= 0:
        return 0, ()
    types = tuple(cfg.get("layer_types") or ())
    if not types and "max_window_layers" in cfg:
        first = int(cfg["max_window_layers"])
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])
        )
    n = cfg["num_hidden_layers"]
    if types and (len(types) != n or set(types) - {"sliding_attention", "full_attention"}):
        raise ValueError(f"layer_types must name each of the {n} layers sliding_attention or full_attention")
    return window, types


def _activation(name: str) -> str:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    return "silu" if name in ("silu", "swish") else name
