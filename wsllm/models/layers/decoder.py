"""One decoder layer: pre-norm attention and pre-norm feed-forward (the dense MLP, or the mixture
of experts where the config says this layer has one), each branch scaled by the residual
multiplier (Granite's; 1 elsewhere) before its residual add. With `sandwich_norms` (Gemma 2/3)
each branch's output is normed too before it is added (`attn_post_norm`, `ffn_post_norm`; the
norm before the feed-forward keeps the name `post_attention_layernorm`, a Llama's).

`forward` is the layer; `native_ops` writes the same steps, in the same order, into the decode
stack's program (kernels/decode_stack.py), so that the native stack runs the layer the model
describes rather than a copy of it in C++."""

from __future__ import annotations

import torch
from torch import nn

from wsllm import kernels
from wsllm.models.config import ModelConfig
from wsllm.models.layers.attention import Attention, AttentionMetadata
from wsllm.models.layers.mlp import MLP
from wsllm.models.layers.moe import MoE
from wsllm.models.layers.norms import RMSNorm


def feed_forward(c: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: the dense MLP, or the mixture of experts."""
    if c.layer(layer).moe:
        return MoE(c, layer)
    return MLP(c.hidden_size, c.intermediate_size, layer, activation=c.hidden_act)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = feed_forward(c, layer)
        self.residual_multiplier = c.residual_multiplier
        self.sandwich = c.sandwich_norms
        if c.sandwich_norms:
            self.attn_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.ffn_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the last layer's output (the embeddings first)
        residual: torch.Tensor | None,  # the residual stream before x is added (None: the first layer)
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, positions, cos_sin, kv, meta)
        if self.sandwich:
            h = self.attn_post_norm.forward(h)
        h, residual = self.post_attention_layernorm.forward(self._scaled(h), residual)
        h = self.mlp.forward(h, meta.lora)
        if self.sandwich:
            h = self.ffn_post_norm.forward(h)
        return self._scaled(h), residual

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier
        return h if m == 1.0 else h.mul_(m)

    def native_ops(self, prog: kernels.StackProgram, kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """`forward`'s steps for a decode-only step, into the stack's program; False where a
        piece cannot run there (a float projection): such steps run layer by layer."""
        m = self.residual_multiplier
        ok = self.input_layernorm.native_ops(prog) and self.self_attn.native_ops(prog, kv)
        if ok and self.sandwich:
            ok = self.attn_post_norm.native_ops(prog, residual=False)
        if ok and m != 1.0:
            prog.scale(m)
        ok = ok and self.post_attention_layernorm.native_ops(prog)
        ok = ok and bool(getattr(self.mlp, "native_ops", None)) and self.mlp.native_ops(prog)
        if ok and self.sandwich:
            ok = self.ffn_post_norm.native_ops(prog, residual=False)
        if ok and m != 1.0:
            prog.scale(m)
        return ok


__all__ = ["DecoderLayer", "feed_forward"]
