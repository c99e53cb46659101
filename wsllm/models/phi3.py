"""Phi-3, Phi-3.5 and Phi-4-mini (Phi3ForCausalLM): a Llama with fused weights (`qkv_proj` and
`gate_up_proj` are already the shared layers' own), LongRoPE (short and long factors per
frequency, an attention factor on cos and sin: kernels/rotary.py), partial rotary (Phi-4-mini
turns 3/4 of each head: wsllm/models/rope.py) and, where the config has one, a sliding window on
every layer (Phi-3-mini-4k's 2,047).

A GGUF keeps q|k|v in one `attn_qkv`, gate|up in one `ffn_up` (twice the rows), the factors in
`rope_factors_long` / `rope_factors_short` with `rope.scaling.original_context_length`, and the
rotary width in `rope.dimension_count`."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base, hf_rope
from wsllm.models.family import Family, GGUFMeta

#: Phi3Config's defaults (transformers), for the keys config.json leaves out when equal
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "sliding_window": None,
}


def config(cfg: dict[str, Any]) -> ModelConfig:
    cfg = DEFAULTS | cfg
    _, scaling = hf_rope(cfg)
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind not in ("longrope", "su", "yarn"):  # "su" and "yarn": old names of longrope (HF)
            raise ValueError(f"Phi-3 rope scaling {kind!r} is not supported (longrope)")
        original = cfg.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings"
        )
        scaling = dict(scaling, rope_type="longrope", original_max_position_embeddings=original)
    return hf_base(
        cfg,
        "phi3",
        rope_scaling=scaling,
        partial_rotary_factor=float(factor),
        sliding_window=int(cfg.get("sliding_window") or 0),
    )


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    hidden, heads = int(meta.get("embedding_length")), int(meta.get("attention.head_count"))
    head_dim = hidden // heads
    rot = int(meta.get("rope.dimension_count") or head_dim)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    original = meta.get("rope.scaling.original_context_length")
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        rope |= {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
        attn = meta.get("rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
    elif (long is None) != (short is None):
        raise ValueError("a Phi-3 GGUF has both rope_factors_long and rope_factors_short, or neither")
    rope["partial_rotary_factor"] = rot / head_dim
    cfg: dict[str, Any] = {
        "head_dim": head_dim,
        "partial_rotary_factor": rot / head_dim,
        "rope_parameters": rope,
        "sliding_window": int(meta.get("attention.sliding_window", 0) or 0) or None,
    }
    if original is not None:
        cfg["original_max_position_embeddings"] = int(original)
        rope["original_max_position_embeddings"] = int(original)
    return cfg


FAMILY = Family(
    name="phi3",
    config=config,
    hf_architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_architectures=("phi3",),
    gguf_config=gguf_config,
)
