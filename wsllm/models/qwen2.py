"""Qwen2 and Qwen2.5: a Llama with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    return hf_base(cfg, "qwen2", qkv_bias=True)


FAMILY = Family(
    name="qwen2",
    config=config,
    hf_architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    gguf_architectures=("qwen2",),
)
