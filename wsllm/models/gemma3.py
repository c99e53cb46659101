"""Gemma 3 (text: Gemma3ForCausalLM, 270M and 1B; the larger ones' language model is the same):
Gemma 2's pieces (wsllm/models/gemma2.py) with RMSNorm over each head of q and k (Gemma's (1 + w)
too), five sliding layers (`sliding_window`) to each full one, and a rotary base per layer type:
`rope_local_base_freq` (10k) unscaled on the sliding layers, `rope_theta` (1M) with its scaling
(linear, factor 8 from 4B up) on the full ones. No attention soft-cap (HF's Gemma 3 attention
takes none, whatever the config says); a final soft-cap where the config has one.

Its config comes as transformers 4 wrote it (rope_theta, rope_local_base_freq, rope_scaling,
sliding_window_pattern) or as 5 does (rope_parameters per layer type, layer_types)."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family, GGUFMeta
from wsllm.models.gemma2 import RENAMES, gemma_knobs, gguf_gemma, layer_types

#: Gemma3TextConfig's defaults (transformers), for the keys config.json leaves out when equal
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0


def rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(the full layers' base, their scaling or None, the sliding layers' base)."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"a scaled rotary on Gemma 3's sliding layers ({local['rope_type']}) is not supported"
        )
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    theta = cfg.get("rope_theta") or full.get("rope_theta") or GLOBAL_THETA
    local_theta = cfg.get("rope_local_base_freq") or local.get("rope_theta") or LOCAL_THETA
    return float(theta), scaling, float(local_theta)


def config(cfg: dict[str, Any]) -> ModelConfig:
    cfg = DEFAULTS | cfg
    theta, scaling, local_theta = rope(cfg)
    return hf_base(
        cfg,
        "gemma3",
        **gemma_knobs(cfg),
        layer_types=layer_types(cfg, int(cfg.get("sliding_window_pattern") or 6)),
        qk_norm="head",
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
    )


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    cfg = gguf_gemma(meta, 62)
    full: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get("rope.freq_base", GLOBAL_THETA)),
    }
    kind, factor = meta.get("rope.scaling.type"), meta.get("rope.scaling.factor")
    if kind == "linear" and factor and float(factor) != 1.0:
        full |= {"rope_type": "linear", "factor": float(factor)}
    elif kind not in (None, "none", "linear"):
        raise ValueError(f"Gemma 3 GGUF rope scaling {kind!r} is not supported")
    local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", LOCAL_THETA))}
    cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    pattern = meta.get("attention.sliding_window_pattern")
    n = int(meta.get("block_count"))
    if isinstance(pattern, list):  # per layer: true for a sliding one
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern[:n]]
    elif pattern:
        cfg["layer_types"] = list(layer_types({"num_hidden_layers": n}, int(pattern)))
    return cfg


FAMILY = Family(
    name="gemma3",
    config=config,
    hf_architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    gguf_config=gguf_config,
    hf_renames=RENAMES,
)
