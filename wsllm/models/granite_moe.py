"""Granite-MoE and Granite-MoE-Shared (IBM Granite 3 MoE): a Llama with four multipliers (the
embeddings', each branch's before its residual add, the attention scale, and the logits divided by
`logits_scaling`) and a mixture of experts on every layer: top-k on the router's logits, then a
softmax over the k; Granite-MoE-Shared adds a shared expert, ungated. Its experts come stacked
(`input_linear` [E, 2I, H]: gate rows then up rows; `output_linear` [E, H, I])."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, MoeConfig, hf_base
from wsllm.models.family import Family, GGUFMeta


def config(cfg: dict[str, Any]) -> ModelConfig:
    moe = MoeConfig(
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        gating="softmax_topk",
        shared_intermediate_size=cfg.get("shared_intermediate_size") or 0,
    )
    return hf_base(
        cfg,
        "granite_moe",
        moe=moe,
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
    )


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    shared = int(meta.get("expert_shared_feed_forward_length", 0) or 0)
    cfg = {
        "num_local_experts": meta.experts,
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "intermediate_size": int(meta.get("expert_feed_forward_length") or meta.get("feed_forward_length")),
        "embedding_multiplier": float(meta.get("embedding_scale", 1.0)),
        "residual_multiplier": float(meta.get("residual_scale", 1.0)),
        "logits_scaling": float(meta.get("logit_scale", 1.0)),
    }
    if meta.get("attention.scale") is not None:
        cfg["attention_multiplier"] = float(meta.get("attention.scale"))
    if shared:
        cfg["shared_intermediate_size"] = shared
        cfg["architectures"] = ["GraniteMoeSharedForCausalLM"]
        cfg["model_type"] = "granitemoeshared"
    return cfg


FAMILY = Family(
    name="granite_moe",
    config=config,
    hf_architectures=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    model_types=("granitemoe", "granitemoeshared"),
    gguf_architectures=("granitemoe",),
    gguf_permuted_qk=True,
    gguf_config=gguf_config,
    hf_renames=(
        (r"\.block_sparse_moe\.router\.layer\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up"),
        (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down"),
        (r"\.shared_mlp\.input_linear\.", ".mlp.shared_expert.gate_up_proj."),
        (r"\.shared_mlp\.output_linear\.", ".mlp.shared_expert.down_proj."),
    ),
)
