"""The KV cache tensors: per layer K and V `[num_blocks, block_size, num_kv_heads,
head_dim]`, sized from a memory budget (`num_kv_blocks`). Also does block copies
(copy-on-write) and swaps between device and CPU blocks.

A model with several KV groups (kv_groups.py: layers of different windows) has per layer the
blocks of its group (`split_blocks` shares the budget), and the copies and swaps it is handed
are in one id space: a group's ids offset by the blocks of the groups before it."""

from __future__ import annotations

import logging

import torch

from wsllm.config import EngineConfig
from wsllm.engine.kv_groups import KVGroup
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


def group_block_bytes(
    c: ModelConfig, groups: list[KVGroup], block_size: int, dtype: torch.dtype
) -> list[int]:
    """Per KV group, the bytes of one of its blocks (its layers' K and V)."""
    per_layer = bytes_per_block(c, block_size, dtype) // c.num_layers
    return [per_layer * len(g.layers) for g in groups]


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
        num_blocks: int | list[int],  # per KV group when a list
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int | list[int] = 0,
        groups: list[KVGroup] | None = None,  # None: one group of every layer
    ) -> None:
        self.groups = groups or [KVGroup(0, tuple(range(c.num_layers)))]
        self.sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        cpu = [num_cpu_blocks] if isinstance(num_cpu_blocks, int) else list(num_cpu_blocks)
        self.cpu_sizes = cpu if any(cpu) else [0] * len(self.groups)
        self.offsets = [sum(self.sizes[:g]) for g in range(len(self.sizes))]
        self.cpu_offsets = [sum(self.cpu_sizes[:g]) for g in range(len(self.cpu_sizes))]
        group_of = {i: g for g, group in enumerate(self.groups) for i in group.layers}
        self.layer_group = [group_of[i] for i in range(c.num_layers)]
        pin = device.type == "cuda"

        def shape(n: int) -> tuple[int, int, int, int]:
            return (n, block_size, c.num_kv_heads, c.head_dim)

        self.kv_caches = [
            (
                torch.zeros(shape(self.sizes[g]), dtype=dtype, device=device),
                torch.zeros(shape(self.sizes[g]), dtype=dtype, device=device),
            )
            for g in self.layer_group
        ]
        self.cpu_caches = [
            (
                torch.zeros(shape(self.cpu_sizes[g]), dtype=dtype, pin_memory=pin),
                torch.zeros(shape(self.cpu_sizes[g]), dtype=dtype, pin_memory=pin),
            )
            for g in self.layer_group
            if any(self.cpu_sizes)
        ]
        self.block_bytes = group_block_bytes(c, self.groups, block_size, dtype)
        log.info(
            "KV cache: %s blocks of %d tokens, %s, %.0f MiB (%s CPU swap blocks)",
            "+".join(map(str, self.sizes)),
            block_size,
            str(dtype).removeprefix("torch."),
            sum(n * b for n, b in zip(self.sizes, self.block_bytes, strict=True)) / 2**20,
            "+".join(map(str, self.cpu_sizes)),
        )

    @property
    def kv_bytes(self) -> int:
        """The device KV cache's bytes, every group's."""
        return sum(n * b for n, b in zip(self.sizes, self.block_bytes, strict=True))

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

    def _by_group(self, pairs: list[tuple[int, int]], second: list[int]) -> list[list[tuple[int, int]]]:
        """The pairs of each group in its own ids (by the first id's range; the second id is
        offset by `second`, the device's or the CPU's offsets)."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for a, b in pairs:
            g = len(self.offsets) - 1
            while a < self.offsets[g]:
                g -= 1
            out[g].append((a - self.offsets[g], b - second[g]))
        return out

    def _layers(self, g: int) -> list[int]:
        return [i for i, lg in enumerate(self.layer_group) if lg == g]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        device = self.kv_caches[0][0].device
        for g, mine in enumerate(self._by_group(pairs, self.offsets)):
            if not mine:
                continue
            src = self._index([s for s, _ in mine], device)
            dst = self._index([d for _, d in mine], device)
            for i in self._layers(g):
                k, v = self.kv_caches[i]
                k[dst] = k[src]
                v[dst] = v[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): device -> CPU, one gather per layer."""
        for g, mine in enumerate(self._by_group(pairs, self.cpu_offsets)):
            if not mine:
                continue
            dev = self._index([d for d, _ in mine], self.kv_caches[0][0].device)
            cpu = self._index([c for _, c in mine], torch.device("cpu"))
            for i in self._layers(g):
                (k, v), (ck, cv) = self.kv_caches[i], self.cpu_caches[i]
                ck.index_copy_(0, cpu, k.index_select(0, dev).cpu())
                cv.index_copy_(0, cpu, v.index_select(0, dev).cpu())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block): CPU -> device, one scatter per layer."""
        device = self.kv_caches[0][0].device
        for g, mine in enumerate(self._by_group(pairs, self.cpu_offsets)):
            if not mine:
                continue
            dev = self._index([d for d, _ in mine], device)
            cpu = self._index([c for _, c in mine], torch.device("cpu"))
            for i in self._layers(g):
                (k, v), (ck, cv) = self.kv_caches[i], self.cpu_caches[i]
                k.index_copy_(0, dev, ck.index_select(0, cpu).to(device, non_blocking=True))
                v.index_copy_(0, dev, cv.index_select(0, cpu).to(device, non_blocking=True))

    @staticmethod
    def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=device)
