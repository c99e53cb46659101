"""SmolLM3 (SmolLM3ForCausalLM): a Llama whose every fourth layer has no rotary (NoPE:
`no_rope_layers`, 0 for such a layer; loaded as a Llama it would rotate them and give wrong text
silently), tied embeddings and a 2M rotary base. `use_sliding_window` windows the NoPE layers
(HF's `layer_types`); released models have it off.

A GGUF (llama.cpp's converter writes it as a Llama: Q and K rows permuted) says nothing of the
NoPE layers: llama.cpp's rule, every fourth, is `no_rope_layer_interval`'s default here too."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family, GGUFMeta

#: SmolLM3Config's defaults (transformers), for the keys config.json leaves out when equal
DEFAULTS: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "no_rope_layer_interval": 4,
    "use_sliding_window": False,
    "sliding_window": None,
}
THETA = 2_000_000.0


def config(cfg: dict[str, Any]) -> ModelConfig:
    cfg = DEFAULTS | cfg
    if cfg.get("mlp_bias"):
        raise ValueError("SmolLM3 with mlp_bias is not supported")
    n, every = cfg["num_hidden_layers"], int(cfg["no_rope_layer_interval"])
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    nope = tuple(i for i in range(n) if not uses_rope[i])
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window") else 0
    types = cfg.get("layer_types") or [
        "sliding_attention" if i in nope else "full_attention" for i in range(n)
    ]
    has_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    return hf_base(
        # hf_base refuses use_sliding_window (Qwen2's); here it is read above, per layer
        cfg | {"use_sliding_window": False},
        "smollm3",
        nope_layers=nope,
        sliding_window=window,
        layer_types=tuple(types) if window else (),
        **({} if has_theta else {"rope_theta": THETA}),
    )


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    cfg: dict[str, Any] = {"no_rope_layer_interval": 4}
    window = int(meta.get("attention.sliding_window", 0) or 0)  # llama.cpp writes none; read if there
    if window:
        cfg |= {"use_sliding_window": True, "sliding_window": window}
    return cfg


FAMILY = Family(
    name="smollm3",
    config=config,
    hf_architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    gguf_permuted_qk=True,
    gguf_config=gguf_config,
)
