"""OLMoE (OLMoE-1B-7B): RMSNorm over the whole width of q and of k (not per head), and a mixture of
experts on every layer: a softmax router, top-k, renormalized when `norm_topk_prob` (off in the
released models), no shared expert."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, MoeConfig, hf_base
from wsllm.models.family import Family, GGUFMeta


def config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"olmoe: clip_qkv ({cfg['clip_qkv']}) is not supported")
    moe = MoeConfig(
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)),
    )
    return hf_base(cfg, "olmoe", qk_norm="full", moe=moe)


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    return {
        "num_experts": meta.experts,
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "intermediate_size": int(meta.get("expert_feed_forward_length") or meta.get("feed_forward_length")),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", False)),
    }


FAMILY = Family(
    name="olmoe",
    config=config,
    hf_architectures=("OlmoeForCausalLM",),
    model_types=("olmoe",),
    gguf_architectures=("olmoe",),
    gguf_config=gguf_config,
)
