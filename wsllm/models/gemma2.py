"""Gemma 2: a Llama with Gemma's pieces, each a ModelConfig field: RMSNorm scaling by (1 + w)
(`norm_offset`, folded into the weights as an HF checkpoint loads; llama.cpp's converter has
already added it), the embeddings times sqrt(hidden), GeGLU (gelu_pytorch_tanh), sandwich norms
(each branch's output normed before its residual add), q.k scaled by query_pre_attn_scalar ** -0.5,
attention logits soft-capped at 50 and the final logits at 30, and sliding windows (4,096 tokens)
on every other layer, the first one windowed (HF's `layer_types`).

HF's config.json leaves out what equals Gemma2Config's defaults, so those are read from
`DEFAULTS`. A GGUF does not say query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B
(46 layers) and head_dim for the others, as does `gguf_config` unless the file has
`attention.scale`."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family, GGUFMeta

#: Gemma2Config's defaults (transformers), for the keys config.json leaves out when equal
DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}

#: HF's names for Gemma's sandwich norms -> the shared layers' (layers/decoder.py)
RENAMES = (
    (r"\.post_attention_layernorm\.", ".attn_post_norm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".ffn_post_norm."),
)


def layer_types(cfg: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """HF's `layer_types`, or its default: every `pattern`-th layer full, the others sliding."""
    given = cfg.get("layer_types")
    if given:
        return tuple(given)
    n = cfg["num_hidden_layers"]
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


def gemma_knobs(cfg: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: norms, embedding scale, GeGLU, the q.k scale, the windows."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported: a decoder is served")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma's hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    return dict(
        hidden_act="gelu_tanh",
        attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        sliding_window=int(cfg.get("sliding_window") or 0),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
    )


def config(cfg: dict[str, Any]) -> ModelConfig:
    cfg = DEFAULTS | cfg
    return hf_base(
        cfg,
        "gemma2",
        **gemma_knobs(cfg),
        layer_types=layer_types(cfg, 2),
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
    )


def gguf_query_scalar(meta: GGUFMeta, big_layers: int) -> int | float:
    """query_pre_attn_scalar from a GGUF: `attention.scale` (as 1 / sqrt(it)) where the file has
    it, else llama.cpp's rule: hidden / heads for the 27B (`big_layers` layers), head_dim otherwise."""
    scale = meta.get("attention.scale")
    if scale:
        q = float(scale) ** -2  # the file's float32 scale: a whole number back as one
        return round(q) if abs(q - round(q)) < 1e-3 * q else q
    hidden, heads = int(meta.get("embedding_length")), int(meta.get("attention.head_count"))
    if int(meta.get("block_count")) == big_layers:
        return hidden // heads if hidden % heads == 0 else hidden / heads
    return int(meta.get("attention.key_length") or hidden // heads)


def gguf_gemma(meta: GGUFMeta, big_layers: int) -> dict[str, Any]:
    """What Gemma 2 and 3 GGUFs share (their norms already hold llama.cpp's + 1)."""
    cfg: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": gguf_query_scalar(meta, big_layers),
        "sliding_window": int(meta.get("attention.sliding_window", 0) or 0) or None,
        "final_logit_softcapping": float(meta.get("final_logit_softcapping", 0) or 0) or None,
    }
    return cfg


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    cfg = gguf_gemma(meta, 46)
    cfg["attn_logit_softcapping"] = float(meta.get("attn_logit_softcapping", 0) or 0) or None
    return cfg


FAMILY = Family(
    name="gemma2",
    config=config,
    hf_architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    gguf_config=gguf_config,
    hf_renames=RENAMES,
)
