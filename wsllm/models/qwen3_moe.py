"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention (RMSNorm over each head of q
and k) and a mixture of experts on every `decoder_sparse_step`-th layer outside `mlp_only_layers`:
a softmax router, top-k, renormalized when `norm_topk_prob`, no shared expert."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, MoeConfig, hf_base
from wsllm.models.family import Family, GGUFMeta


def config(cfg: dict[str, Any]) -> ModelConfig:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step = cfg.get("decoder_sparse_step") or 1
    dense = tuple(
        i
        for i in range(cfg["num_hidden_layers"])
        if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step
    )
    moe = MoeConfig(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense,
    )
    return hf_base(cfg, "qwen3_moe", qk_norm="head", moe=moe)


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    return {
        "num_experts": meta.experts,
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "moe_intermediate_size": int(meta.get("expert_feed_forward_length")),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),  # llama.cpp renormalizes qwen3moe
        "mlp_only_layers": list(range(int(meta.get("leading_dense_block_count", 0) or 0))),
        "decoder_sparse_step": 1,
    }


FAMILY = Family(
    name="qwen3_moe",
    config=config,
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    gguf_config=gguf_config,
)
