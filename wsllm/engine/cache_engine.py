"""The KV cache tensors: per layer K and V `[num_blocks, block_size, num_kv_heads,
head_dim]`, sized from a memory budget. Also does block copies (copy-on-write)
and swaps between device and CPU blocks."""

from __future__ import annotations

import logging

import torch

from wsllm.models.llama import ModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(c: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem


def num_blocks_for_budget(c: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
    return max(1, int(budget_bytes // bytes_per_block(c, block_size, dtype)))


class CacheEngine:
    def __init__(
        self,
        c: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
    ) -> None:
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_layers)
        ]
        cpu_shape = (num_cpu_blocks, block_size, c.num_kv_heads, c.head_dim)
        pin = device.type == "cuda"
        self.cpu_caches = (
            [
                (
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                    torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin),
                )
                for _ in range(c.num_layers)
            ]
            if num_cpu_blocks
            else []
        )
        log.info(
            "KV cache: %d blocks of %d tokens (%d CPU swap blocks)", num_blocks, block_size, num_cpu_blocks
        )

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv_caches[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=src.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): device -> CPU."""
        for dev_b, cpu_b in pairs:
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches, strict=True):
                ck[cpu_b].copy_(k[dev_b])
                cv[cpu_b].copy_(v[dev_b])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): CPU -> device."""
        for dev_b, cpu_b in pairs:
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches, strict=True):
                k[dev_b].copy_(ck[cpu_b])
                v[dev_b].copy_(cv[cpu_b])
