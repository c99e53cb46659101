"""SmolVLM (Idefics3): a Llama text model behind a SigLIP image side. The family reads its
`text_config` as a Llama's and renames `text_model.*` to the shared layers' names; the
image side's tensors (`vision_model.*`, `connector.*`) are not the text model's and are
left to the image side (wsllm/models/vision/idefics3.py). Until the engine's image path
is wired, a SmolVLM checkpoint serves text (docs/vision.md)."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    text = dict(cfg["text_config"])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return hf_base(text, "idefics3")


FAMILY = Family(
    name="idefics3",
    config=config,
    hf_architectures=("Idefics3ForConditionalGeneration",),
    model_types=("idefics3",),
    hf_renames=((r"^text_model\.", ""),),
    image_side=("vision_model.", "connector."),
)
