"""Write a step's K and V into their cache slots."""

from __future__ import annotations

from typing import Any

import torch

from ._lazy import triton_op


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


def __getattr__(name: str) -> Any:
    # The Triton version is in elementwise.py, imported on first use; see _lazy.py.
    if name in ("store_kv_triton",):
        return triton_op(__package__, "elementwise", name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
