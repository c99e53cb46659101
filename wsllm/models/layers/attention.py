"""Attention over the paged KV cache: grouped-query heads, fused q/k/v projection (with its bias
where the config has one), QK-norm per head or over the whole width, rotary (by the layer's own
table: wsllm/models/rope.py), the KV store and paged attention. `AttentionMetadata` is what a
step's attention needs to find each token's KV, passed explicitly, never through a global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsllm import kernels
from wsllm.kernels.lora import SLOTS
from wsllm.models.config import ModelConfig
from wsllm.models.layers.norms import RMSNorm
from wsllm.models.rope import layer_rope

#: LoRA slots of a layer (kernels/lora.py: SLOTS): the attention's two projections
QKV_SLOT, O_SLOT = 0, 1


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs to find each token's KV. Built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's tokens
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token
    max_seq_len: int = 0  # the longest context, so no kernel asks the device for it
    # CPU attention, planned once per step for every layer (None: the dispatched kernels)
    cpu_plan: kernels.CpuAttentionPlan | None = None
    # The step's LoRA adapters and their rows (models/lora.py: LoraBatch); None: no row has one
    lora: Any = None
    # A model of several KV groups (engine/kv_groups.py: layers of different windows): each
    # group's metadata (its slots, block tables and plan), in ModelConfig.windows' order
    groups: tuple[AttentionMetadata, ...] = ()


def lora_key(layer: int, slot: int) -> int:
    """A projection's key among the LoRA pieces (kernels/lora.py: layer * len(SLOTS) + slot)."""
    return layer * len(SLOTS) + slot


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # its index: which LoRA pieces its projections take
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_bias)
        self.scale = c.scale
        spec = c.layer(layer)  # its attention variant: window, soft-cap, sinks (off by default)
        self.window, self.softcap = spec.window, spec.softcap
        self.rope = layer_rope(c, layer)  # its rotary table's index (wsllm/models/rope.py)
        self.kv_group = c.windows().index(spec.window)  # whose blocks it reads (engine/kv_groups.py)
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if spec.sinks else None
        self.qk_norm = c.qk_norm
        if c.qk_norm != "none":  # per head: over head_dim; full: over all of q's (k's) width
            full = c.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if full else c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.groups:  # its KV group's blocks (engine/kv_groups.py)
            meta = meta.groups[self.kv_group]
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [num_tokens, (H + 2 Hk) * D]
        if meta.lora is not None:  # the adapters' deltas on their rows (slots: kernels/lora.py)
            meta.lora.apply(self.layer, QKV_SLOT, x, qkv)
        if self.qk_norm != "none":
            self._norm_qk(qkv)
        if meta.cpu_plan is not None:  # rotary, KV store and attention in one CPU block
            o = kernels.cpu_attention_block(
                qkv,
                kv[0],
                kv[1],
                meta.cpu_plan,
                self.num_heads,
                self.scale,
                rope=self.rope,
                **self._variant(),
            )
            return self._out(o, meta.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, cos_sin if cos_sin.dim() == 2 else cos_sin[self.rope])
        k_cache, v_cache = kv
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            o = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, **self._variant()
            )
        else:
            o = kernels.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                self.scale,
                meta.max_query_len,
                **self._variant(),
            )
        return self._out(o.reshape(t, self.q_size), meta.lora)

    def _variant(self) -> dict[str, Any]:
        """The layer's attention variant as the kernels' keywords (kernels/paged_attention.py)."""
        sinks = None if self.sinks is None else self.sinks.float()
        return {"window": self.window, "softcap": self.softcap, "sinks": sinks}

    def _out(self, o: torch.Tensor, lora: Any) -> torch.Tensor:  # [num_tokens, H * D] -> [num_tokens, hidden]
        y = self.o_proj.forward(o)
        if lora is not None:
            lora.apply(self.layer, O_SLOT, o, y)
        return y

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """QK-norm in place on the fused projection's output, so that both attention paths
        (the CPU block and the kernels) read normalized q and k. Each part's rows (a head's
        D values, or the whole part) are normalized as one contiguous matrix, as the decode
        stack's kQkNorm does them (the same kernel: the same bits)."""
        t = qkv.shape[0]
        for norm, start, size in ((self.q_norm, 0, self.q_size), (self.k_norm, self.q_size, self.kv_size)):
            part = qkv[:, start : start + size]
            rows = part.reshape(-1, norm.weight.shape[0])  # a copy where the part is strided in qkv
            part.copy_(norm.forward(rows).view(t, size))

    def native_ops(self, prog: kernels.StackProgram, kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """The decode stack's form of a decode-only `forward` (the CPU plan's attention block)."""
        if not prog.linear(self.qkv_proj, lora_key(self.layer, QKV_SLOT)):
            return False
        if self.qk_norm != "none" and not prog.qk_norm(
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_size, self.kv_size
        ):
            return False
        v = self._variant()
        prog.attention(
            kv[0],
            kv[1],
            self.num_heads,
            self.scale,
            v["window"],
            v["softcap"],
            v["sinks"],
            self.rope,
            self.kv_group,
        )
        return prog.linear(self.o_proj, lora_key(self.layer, O_SLOT))
