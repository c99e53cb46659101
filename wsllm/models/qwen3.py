"""Qwen3 (dense): a Llama with RMSNorm over each head of q and k before rotary, and a head_dim
the config gives (not hidden_size / heads)."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    return hf_base(cfg, "qwen3", qk_norm="head")


FAMILY = Family(
    name="qwen3",
    config=config,
    hf_architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf_architectures=("qwen3",),
)
