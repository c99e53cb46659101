"""The families this server runs, and the one table that finds a checkpoint's: HF `architectures`
(then `model_type`) and GGUF `general.architecture` -> its Family (wsllm/models/family.py).

A new family is a file beside this one (its config reader and its Family) and one line in
FAMILIES; docs/models.md says what each needs."""

from __future__ import annotations

from typing import Any

from wsllm.models import llama, qwen2, qwen3
from wsllm.models.config import ModelConfig
from wsllm.models.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
)

_BY_ARCH = {a: f for f in FAMILIES for a in f.hf_architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF = {a: f for f in FAMILIES for a in f.gguf_architectures}


def for_hf(cfg: dict[str, Any]) -> Family:
    """The family of an HF config.json; ValueError naming what it is when none runs it."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not archs and model_type is None:
        return llama.FAMILY  # a bare Llama config
    family = (_BY_ARCH.get(archs[0]) if archs else None) or _BY_TYPE.get(model_type or "")
    if family is None:
        served = ", ".join(sorted(_BY_ARCH))
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} (model_type {model_type!r}); served: {served}"
        )
    return family


def for_gguf(architecture: str) -> Family:
    """The family of a GGUF's `general.architecture`; ValueError when none runs it."""
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; served: {', '.join(sorted(_BY_GGUF))}"
        )
    return family


def model_config(cfg: dict[str, Any]) -> ModelConfig:
    """An HF config.json's ModelConfig, read by its family."""
    return for_hf(cfg).config(cfg)
