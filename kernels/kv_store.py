"""Write a step's K and V into their cache slots."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block * block_size + offset; -1 skips
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))
