"""CPU swap space for preemption by swapping: a pool of CPU blocks and, per
swapped sequence, where its KV went. The cache engine does the copies.

A model with several KV groups (kv_groups.py) swaps each group into a pool of its own
(`CpuSwapSpace` holds a `GroupSwap` per group; a model of one group has one); a windowed table's null entries (the blocks its window gave back) stay
null, so only the blocks a sequence still reads travel. Pairs are in the cache engine's one id
space: a group's device and CPU ids offset by the groups before it."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.kv_groups import HybridBlockManager, KVManager
from wsllm.engine.sequence import Sequence


class GroupSwap:
    """One KV group's swap pool."""

    def __init__(self, num_cpu_blocks: int, dev_offset: int = 0, cpu_offset: int = 0) -> None:
        self.num_blocks = num_cpu_blocks
        self._free = list(range(num_cpu_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}  # a windowed table's null entries as -1
        self.dev_offset, self.cpu_offset = dev_offset, cpu_offset

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_swap_out(self, seq: Sequence, bm: BlockManager) -> bool:
        table = bm.block_tables.get(seq.seq_id, [])
        return sum(b != bm.null for b in table) <= len(self._free)

    def swap_out(self, seq: Sequence, bm: BlockManager) -> list[tuple[int, int]]:
        """Move the sequence's blocks to CPU; returns (device_block, cpu_block) copies."""
        table = bm.block_tables[seq.seq_id]
        cpu = [-1 if b == bm.null else self._free.pop() for b in table]
        self._tables[seq.seq_id] = cpu
        pairs = [
            (d + self.dev_offset, c + self.cpu_offset) for d, c in zip(table, cpu, strict=True) if c >= 0
        ]
        bm.free(seq.seq_id)
        return pairs

    def can_swap_in(self, seq: Sequence, bm: BlockManager) -> bool:
        need = sum(c >= 0 for c in self._tables[seq.seq_id]) + 1  # and room for the next token
        return bm.num_free_blocks - need >= bm.watermark_blocks

    def swap_in(self, seq: Sequence, bm: BlockManager) -> list[tuple[int, int]]:
        cpu = self._tables.pop(seq.seq_id)
        dev = iter(bm.take_blocks(sum(c >= 0 for c in cpu)))
        table = [next(dev) if c >= 0 else bm.null for c in cpu]
        bm.set_table(seq.seq_id, table, seq.cache_root, seq.image_spans)
        self._free.extend(c for c in reversed(cpu) if c >= 0)
        return [(d + self.dev_offset, c + self.cpu_offset) for d, c in zip(table, cpu, strict=True) if c >= 0]

    def free(self, seq_id: int) -> None:
        cpu = self._tables.pop(seq_id, None)
        if cpu:
            self._free.extend(c for c in cpu if c >= 0)


class CpuSwapSpace:
    """The scheduler's swap space: one pool per KV group, each call over every group (all or
    nothing); `cpu_sizes` blocks per group."""

    def __init__(self, cpu_sizes: Seq[int], dev_offsets: Seq[int] = (0,)) -> None:
        cpu_offsets = [sum(cpu_sizes[:g]) for g in range(len(cpu_sizes))]
        self.spaces = [
            GroupSwap(n, d, c) for n, d, c in zip(cpu_sizes, dev_offsets, cpu_offsets, strict=True)
        ]

    @property
    def num_blocks(self) -> int:
        return sum(s.num_blocks for s in self.spaces)

    @property
    def num_free_blocks(self) -> int:
        return sum(s.num_free_blocks for s in self.spaces)

    @staticmethod
    def _groups(bm: KVManager) -> list[BlockManager]:
        return bm.groups if isinstance(bm, HybridBlockManager) else [bm]

    def can_swap_out(self, seq: Sequence, bm: KVManager) -> bool:
        return all(s.can_swap_out(seq, g) for s, g in zip(self.spaces, self._groups(bm), strict=True))

    def swap_out(self, seq: Sequence, bm: KVManager) -> list[tuple[int, int]]:
        return [p for s, g in zip(self.spaces, self._groups(bm), strict=True) for p in s.swap_out(seq, g)]

    def can_swap_in(self, seq: Sequence, bm: KVManager) -> bool:
        return all(s.can_swap_in(seq, g) for s, g in zip(self.spaces, self._groups(bm), strict=True))

    def swap_in(self, seq: Sequence, bm: KVManager) -> list[tuple[int, int]]:
        return [p for s, g in zip(self.spaces, self._groups(bm), strict=True) for p in s.swap_in(seq, g)]

    def free(self, seq_id: int) -> None:
        for s in self.spaces:
            s.free(seq_id)


def swap_space(bm: KVManager, cpu_sizes: Seq[int]) -> CpuSwapSpace | None:
    """The swap space for `bm`: `cpu_sizes` blocks per group (None: no swap space)."""
    if not cpu_sizes or not all(cpu_sizes):
        return None
    return CpuSwapSpace(cpu_sizes, bm.offsets if isinstance(bm, HybridBlockManager) else [0])
