"""SmolVLM (Idefics3): a Llama text model behind a SigLIP image side. The family reads its
`text_config` as a Llama's and renames `text_model.*` to the shared layers' names; the
image side's tensors (`vision_model.*`, `connector.*`) are not the text model's and are
the image side's (wsllm/models/vision/idefics3.py: `image_side`, the family's `vision`
hook), which the loader builds beside the text model (docs/vision.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    text = dict(cfg["text_config"])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return hf_base(text, "idefics3")


def vision(
    cfg: dict[str, Any],
    model_dir: Path,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> Any:
    from wsllm.models.vision.idefics3 import image_side  # Pillow and the encoder: only for a model that sees

    return image_side(cfg, model_dir, tensors, device, dtype)


FAMILY = Family(
    name="idefics3",
    config=config,
    hf_architectures=("Idefics3ForConditionalGeneration",),
    model_types=("idefics3",),
    hf_renames=((r"^text_model\.", ""),),
    image_side=("vision_model.", "connector."),
    vision=vision,
)
