"""Qwen3-VL (dense): Qwen3's text model (RMSNorm over each head of q and k) behind a ViT with
2-D rotary and DeepStack (wsllm/models/vision/qwen3_vl.py). The family reads its
`text_config` as a Qwen3's and renames `language_model.*` to the shared layers' names; the
image side's tensors (`visual.*`) are not the text model's. Its text rotary is interleaved
M-RoPE (`mrope_section`), which on text alone (t = h = w) is the ordinary rotary of
`rope_theta`: a text prompt runs as any Qwen3's. An image's prompt needs 3-D positions at
prefill and the deepstack rows in the first layers (qwen3_vl_text.py, vision/qwen3_vl_rope.py;
docs/vision.md says what the engine passes)."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, hf_base
from wsllm.models.family import Family


def config(cfg: dict[str, Any]) -> ModelConfig:
    text = dict(cfg["text_config"])
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("mrope_interleaved") is False:
        raise ValueError("text_config: a non-interleaved mrope (Qwen2-VL's) is not served")
    out = hf_base(text, "qwen3_vl", qk_norm="head")
    if sum(sections := mrope_section(cfg)) != out.head_dim // 2:
        raise ValueError(
            f"text_config: mrope_section {list(sections)} must sum to head_dim / 2 = {out.head_dim // 2}"
        )
    return out


def mrope_section(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """The text model's M-RoPE sections (t, h, w) from a Qwen3-VL config.json."""
    text = cfg["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    t, h, w = rope.get("mrope_section", (24, 20, 20))
    return int(t), int(h), int(w)


FAMILY = Family(
    name="qwen3_vl",
    config=config,
    hf_architectures=("Qwen3VLForConditionalGeneration",),
    model_types=("qwen3_vl",),
    hf_renames=((r"^language_model\.", ""),),
    image_side=("visual.",),
)
