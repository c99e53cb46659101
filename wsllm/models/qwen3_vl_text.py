"""Qwen3-VL's text model over a prompt that holds images: CausalLM's layers (the same
weights, kernels and KV cache as a text step), fed the image rows at the placeholders, 3-D
rotary rows (vision/qwen3_vl_rope.py) and the DeepStack rows added after its first layers.

Not wired into the model runner yet (docs/vision.md): this is the one function a prefill
chunk that holds image tokens runs instead of `CausalLM.forward`; a text-only chunk and every
decode step run `CausalLM.forward` as they are, at positions index + delta."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wsllm.models.causal_lm import CausalLM
from wsllm.models.layers.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ImageRows:
    """A step's image tokens: where they are among its tokens and their packed rows
    (Qwen3VLVision.forward: the input embedding, then each deepstack level's)."""

    at: torch.Tensor  # [k] int64: indices into the step's tokens
    rows: torch.Tensor  # [k, (1 + levels) * hidden]


def forward(
    model: CausalLM,
    input_ids: torch.Tensor,  # [num_tokens]
    rope: torch.Tensor,  # [num_tokens, head_dim]: each token's rotary row (qwen3_vl_rope.rope_rows)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,  # built for these tokens; a CPU plan's rotary from `rope` at arange
    images: ImageRows | None,
) -> torch.Tensor:  # hidden states [num_tokens, hidden]
    c = model.config
    x = model.embed_tokens.forward(input_ids)
    if c.embedding_multiplier != 1.0:
        x = x * c.embedding_multiplier
    stacked: list[torch.Tensor] = []
    if images is not None:
        parts = images.rows.to(x.dtype).split(c.hidden_size, dim=-1)
        x = x.index_copy(0, images.at, parts[0])
        stacked = list(parts[1:])
    index = torch.arange(x.shape[0], device=x.device)
    residual = None
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches, strict=True)):
        x, residual = layer.forward(x, residual, index, rope, kv, meta)
        if i < len(stacked) and images is not None:  # the layer's output is x + residual
            x = x.index_add(0, images.at, stacked[i])
    x, _ = model.norm.forward(x, residual)
    return x
