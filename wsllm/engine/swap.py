"""CPU swap space for preemption by swapping: a pool of CPU blocks and, per
swapped sequence, where its KV went. The cache engine does the copies."""

from __future__ import annotations

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.sequence import Sequence


class CpuSwapSpace:
    def __init__(self, num_cpu_blocks: int) -> None:
        self.num_blocks = num_cpu_blocks
        self._free = list(range(num_cpu_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_swap_out(self, seq: Sequence, bm: BlockManager) -> bool:
        return len(bm.block_tables.get(seq.seq_id, [])) <= len(self._free)

    def swap_out(self, seq: Sequence, bm: BlockManager) -> list[tuple[int, int]]:
        """Move the sequence's blocks to CPU; returns (device_block, cpu_block) copies."""
        table = bm.block_tables[seq.seq_id]
        cpu = [self._free.pop() for _ in table]
        self._tables[seq.seq_id] = cpu
        pairs = list(zip(table, cpu, strict=True))
        bm.free(seq.seq_id)
        return pairs

    def can_swap_in(self, seq: Sequence, bm: BlockManager) -> bool:
        need = len(self._tables[seq.seq_id]) + 1  # and room for the next token
        return bm.num_free_blocks - need >= bm.watermark_blocks

    def swap_in(self, seq: Sequence, bm: BlockManager) -> list[tuple[int, int]]:
        cpu = self._tables.pop(seq.seq_id)
        dev = bm.take_blocks(len(cpu))
        bm.set_table(seq.seq_id, dev, seq.cache_root)
        self._free.extend(reversed(cpu))
        return list(zip(dev, cpu, strict=True))

    def free(self, seq_id: int) -> None:
        cpu = self._tables.pop(seq_id, None)
        if cpu:
            self._free.extend(cpu)
