"""The KV cache tensors: per layer K and V `[num_blocks, block_size, num_kv_heads,
head_dim]`, sized from a memory budget (`num_kv_blocks`). Also does block copies
(copy-on-write) and swaps between device and CPU blocks."""

from __future__ import annotations

import logging

import torch

from wsllm.config import EngineConfig
from wsllm.kernels import cpu_ops
from wsllm.models.build import DTYPES
from wsllm.models.config import ModelConfig

log = logging.getLogger(__name__)


def kv_cache_dtype(asked: str, model_dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """The KV cache's dtype for `--kv-cache-dtype` and why. `auto`: float16 under a float32
    model on a CPU whose native decode kernel reads it in vectors (F16C): half the memory,
    as llama.cpp keeps it; else the model's dtype. On CUDA the cache takes the model's dtype
    (the Triton kernels read one dtype)."""
    if asked == "auto":
        if device.type == "cpu" and model_dtype is torch.float32 and cpu_ops.half_cache_native():
            return torch.float16, "auto: half a float32 cache's memory, widened by the native kernels"
        return model_dtype, "auto: the model's dtype"
    dtype = DTYPES[asked]  # EngineConfig checked the name
    if device.type != "cpu" and dtype is not model_dtype:
        raise ValueError(
            f"kv_cache_dtype {asked} differs from the model's dtype {str(model_dtype).removeprefix('torch.')}, "
            f"which only the CPU kernels support; use auto on {device.type}"
        )
    return dtype, "asked for"


def bytes_per_block(c: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem


def num_blocks_for_budget(c: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: float) -> int:
    return max(1, int(budget_bytes // bytes_per_block(c, block_size, dtype)))


def num_kv_blocks(
    config: EngineConfig, c: ModelConfig, dtype: torch.dtype, device: torch.device, reserved: int = 0
) -> tuple[int, int]:
    """(device blocks, CPU swap blocks) for this engine: `num_kv_blocks` when set, else
    what fits in the budget: a share (`gpu_memory_utilization`) of the GPU memory free
    now, less `reserved` bytes (the decode graphs' pool), or `kv_cache_gb` on a CPU. Swap
    blocks (`swap_space_gb`) only when preemption swaps."""
    bs = config.block_size
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda":
        # torch's allocator keeps what this process freed (a loaded checkpoint's temporaries, the
        # graphs' measuring forward, an earlier engine in this process) where the device does
        # not count it free: handed back first, it is
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.gpu_memory_utilization - reserved
        num_blocks = num_blocks_for_budget(c, bs, dtype, budget)
    else:
        num_blocks = num_blocks_for_budget(c, bs, dtype, config.kv_cache_gb * 2**30)
    swap = config.preemption_mode == "swap"
    num_cpu = num_blocks_for_budget(c, bs, dtype, config.swap_space_gb * 2**30) if swap else 0
    return num_blocks, num_cpu


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
            "KV cache: %d blocks of %d tokens, %s, %.0f MiB (%d CPU swap blocks)",
            num_blocks,
            block_size,
            str(dtype).removeprefix("torch."),
            bytes_per_block(c, block_size, dtype) * num_blocks / 2**20,
            num_cpu_blocks,
        )

    def apply(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        copies: list[tuple[int, int]],
    ) -> None:
        """The scheduler's block work for a step, before its forward pass: swaps out
        (freeing device blocks), swaps in, then copy-on-write copies."""
        if swap_out:
            self.swap_out(swap_out)
        if swap_in:
            self.swap_in(swap_in)
        if copies:
            self.copy(copies)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv_caches[0][0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=src.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): device -> CPU, one gather per layer."""
        dev = self._index([d for d, _ in pairs], self.kv_caches[0][0].device)
        cpu = self._index([c for _, c in pairs], torch.device("cpu"))
        for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches, strict=True):
            ck.index_copy_(0, cpu, k.index_select(0, dev).cpu())
            cv.index_copy_(0, cpu, v.index_select(0, dev).cpu())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): CPU -> device, one scatter per layer."""
        device = self.kv_caches[0][0].device
        dev = self._index([d for d, _ in pairs], device)
        cpu = self._index([c for _, c in pairs], torch.device("cpu"))
        for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_caches, strict=True):
            k.index_copy_(0, dev, ck.index_select(0, cpu).to(device, non_blocking=True))
            v.index_copy_(0, dev, cv.index_select(0, cpu).to(device, non_blocking=True))

    @staticmethod
    def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=device)
