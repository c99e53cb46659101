"""The Llama family: Llama 2 and 3 (llama3 rope scaling), SmolLM2 and Mistral. Grouped-query
attention, RMSNorm, SwiGLU, tied or untied embeddings: the shared layers with no knob turned."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    return hf_base(cfg, "llama")


FAMILY = Family(
    name="llama",
    config=config,
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    gguf_architectures=("llama",),
    gguf_permuted_qk=True,
)
