"""The families this server runs, and the one table that finds a checkpoint's: HF `architectures`
(then `model_type`) and GGUF `general.architecture` -> its Family (wsllm/models/family.py).

A new family is a file beside this one (its config reader and its Family) and one line in
FAMILIES; docs/models.md says what each needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wsllm.models import (
    gemma2,
    gemma3,
    gpt_oss,
    granite_moe,
    idefics3,
    llama,
    mixtral,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_vl,
    smollm3,
)
from wsllm.models.config import ModelConfig
from wsllm.models.family import Family, GGUFMeta
from wsllm.models.gguf_checks import GGUFError

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    olmoe.FAMILY,
    mixtral.FAMILY,
    granite_moe.FAMILY,
    idefics3.FAMILY,
    qwen3_vl.FAMILY,
    gpt_oss.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    smollm3.FAMILY,
)

_BY_ARCH = {a: f for f in FAMILIES for a in f.hf_architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF = {(a, f.gguf_experts): f for f in FAMILIES for a in f.gguf_architectures}


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


def for_gguf(architecture: str, experts: bool = False) -> Family:
    """The family of a GGUF's `general.architecture` (and whether the file has experts);
    ValueError when none runs it."""
    family = _BY_GGUF.get((architecture, experts)) or _BY_GGUF.get((architecture, None))
    if family is None:
        served = ", ".join(sorted({a for a, _ in _BY_GGUF}))
        what = " with experts" if experts else ""
        raise ValueError(f"unsupported GGUF architecture {architecture!r}{what}; served: {served}")
    return family


def gguf_hf_config(
    path: str | Path, fields: dict[str, Any], tensor_names: set[str] | dict[str, Any]
) -> dict[str, Any]:
    """The HF config.json a GGUF stands for, read by its family; GGUFError naming the file when
    its metadata cannot be served (an unknown architecture, more experts a token than it has).
    `tensor_names`: the file's tensors' names, or a dict of them to gguf's tensors (GGUFMeta)."""
    meta = GGUFMeta(fields, tensor_names)
    try:
        family = for_gguf(meta.arch, meta.experts > 0)
        cfg = family.hf_config_from_gguf(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise GGUFError(path, "(the metadata)", str(e).strip("'\"")) from e
    used, count = meta.get("expert_used_count", 0) or 0, meta.experts
    if count and not 1 <= used <= count:
        router = "blk.0.ffn_gate_inp.weight"
        raise GGUFError(
            path,
            router,
            f"{meta.key('expert_used_count')} is {used}, but {meta.key('expert_count')} says {count} experts",
        )
    return cfg


def model_config(cfg: dict[str, Any]) -> ModelConfig:
    """An HF config.json's ModelConfig, read by its family."""
    return for_hf(cfg).config(cfg)
