"""Mixtral: a Mistral whose feed-forward is a mixture of experts on every layer: a softmax router,
top-k, the chosen weights always renormalized, no shared expert. Its checkpoints name the router
`block_sparse_moe.gate` and the experts' projections w1 (gate), w3 (up) and w2 (down); llama.cpp
writes it as a "llama" GGUF with experts."""

from __future__ import annotations

from typing import Any

from wsllm.models.config import ModelConfig, MoeConfig, hf_base
from wsllm.models.family import Family, GGUFMeta


def config(cfg: dict[str, Any]) -> ModelConfig:
    moe = MoeConfig(
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        renormalize=True,
    )
    return hf_base(cfg, "mixtral", moe=moe)


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    return {
        "num_local_experts": meta.experts,
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "intermediate_size": int(meta.get("expert_feed_forward_length") or meta.get("feed_forward_length")),
    }


FAMILY = Family(
    name="mixtral",
    config=config,
    hf_architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    gguf_architectures=("llama",),
    gguf_permuted_qk=True,
    gguf_experts=True,
    gguf_config=gguf_config,
    hf_renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
)
