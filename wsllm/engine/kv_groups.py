"""KV groups: a model whose layers differ in their attention window keeps one block manager
per window (vLLM's hybrid KV cache manager has KV cache groups; llama.cpp keeps a second,
smaller cache for its sliding-window layers).

A group is the layers of one window (`LayerSpec.window`, 0: full attention), the full group
first. Each has its own pool of blocks, its own KV tensors (cache_engine.py: a block of a group
holds its layers only) and its own block table per sequence; a windowed group's table gives
back the blocks its window left behind (block_manager.py). `HybridBlockManager` is the one
object the scheduler sees: each call is all or nothing across the groups, so no group holds a
block that another could not match.

The memory: `split_blocks` shares what `num_blocks` blocks of every layer would take between the
groups. A windowed group gets what its sequences can hold at once (each its window and a step's
chunk: `peak_blocks`; `max_num_seqs` of them, never more than the full model's count), and the
rest goes to the full group: the bytes the windows save become context for the full layers.

Prefix caching stays exact: every group keys its full, computed blocks by the same hash chain
(prefix_hash.py), so a key names the same tokens in every group. A hit of h blocks needs the full
group's blocks 0 .. h - 1 and, of each windowed group, only the blocks the next query's window
reads (from block (h * block_size - W + 1) // block_size on); the entries before are the null
block. The hit is the longest h that every group holds so: a windowed group's given-back blocks
stay cached (evictable, LRU) until their memory is needed, so a conversation's next turn finds
the last window of the turn before. Block ids are each group's own; the copies and swaps the
scheduler hands the cache engine are offset by the groups before (`offsets`), one id space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wsllm.engine.block_manager import BlockManager, NoFreeBlocksError
from wsllm.models.config import ModelConfig
from wsllm.prefix_hash import ImageSpan, nth_key


@dataclass(slots=True, frozen=True)
class KVGroup:
    window: int  # its layers' window in tokens (0: full attention)
    layers: tuple[int, ...]


def kv_groups(c: ModelConfig) -> list[KVGroup]:
    """The model's layers by window, in ModelConfig.windows' order: the full group first (one
    group: every layer alike)."""
    return [KVGroup(w, tuple(i for i in range(c.num_layers) if c.layer(i).window == w)) for w in c.windows()]


def split_blocks(
    groups: Sequence[KVGroup], num_blocks: int, block_size: int, max_num_seqs: int, chunk: int
) -> list[int]:
    """Each group's blocks in the memory of `num_blocks` blocks of every layer (see above).
    `chunk`: the most tokens a sequence computes in a step (max_num_batched_tokens)."""
    if len(groups) == 1 or groups[0].window > 0:  # one group, or windows only: each its own count
        return [num_blocks] * len(groups)
    sizes = [0]
    for g in groups[1:]:
        peak = -(-(g.window - 1 + chunk) // block_size) + 1
        want = max_num_seqs * peak
        sizes.append(max(2, min(num_blocks, want + want // 50 + 2)))  # the watermark, the null block
    layer_blocks = num_blocks * sum(len(g.layers) for g in groups)
    windowed = sum(n * len(g.layers) for n, g in zip(sizes[1:], groups[1:], strict=True))
    sizes[0] = max(1, (layer_blocks - windowed) // len(groups[0].layers))
    return sizes


class HybridBlockManager:
    """One block manager per KV group behind the block manager's interface (the scheduler's,
    the engine's): the first group's capacity is what a request is sized against."""

    def __init__(
        self,
        groups: Sequence[KVGroup],
        sizes: Sequence[int],
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.groups = [
            BlockManager(n, block_size, watermark, enable_prefix_caching, g.window)
            for g, n in zip(groups, sizes, strict=True)
        ]
        self.offsets = [sum(sizes[:g]) for g in range(len(sizes))]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hit_tokens = 0
        self.queried_tokens = 0

    # -- what the engine reads: the first group's, or every group's -----------------
    @property
    def primary(self) -> BlockManager:
        return self.groups[0]

    @property
    def num_blocks(self) -> int:
        return self.primary.num_blocks

    @property
    def watermark_blocks(self) -> int:
        return self.primary.watermark_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.primary.num_free_blocks

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.primary.block_tables

    @property
    def runner_tables(self) -> list[dict[int, list[int]]]:
        """Per group, its block tables (the model runner's)."""
        return [g.block_tables for g in self.groups]

    @property
    def num_cow(self) -> int:
        return sum(g.num_cow for g in self.groups)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return self.primary.blocks_for(num_tokens)

    def usage(self) -> float:
        """The fullest group's share in use."""
        return max(g.usage() for g in self.groups)

    def fits(self, num_tokens: int, chunk: int) -> bool:
        return all(g.fits(num_tokens, chunk) for g in self.groups)

    def cached_keys(self, limit: int) -> list[bytes]:
        return self.primary.cached_keys(limit)

    def check_invariants(self) -> None:
        for g in self.groups:
            g.check_invariants()

    # -- prefix hits across the groups -----------------------------------------------
    def _match(
        self, token_ids: Sequence[int], root: bytes | None, images: Sequence[ImageSpan] = ()
    ) -> tuple[list[list[int]], bytes | None]:
        """Per group, the table entries of the longest hit every group holds (see above),
        and its last chain key."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], root
        bs = self.block_size
        max_full = (len(token_ids) - 1) // bs
        full = self.groups[0] if self.groups[0].window == 0 else None
        keys: list[bytes] = []
        parent = root
        for i in range(max_full):  # a full group's hit ends at its first miss
            parent = nth_key(parent, token_ids, i, bs, images)
            if full is not None and full.lookup(parent) is None:
                break
            keys.append(parent)
        found = [[g.lookup(k) for k in keys] for g in self.groups]
        h = len(keys)
        while h > 0 and not all(self._holds(g, f, h) for g, f in zip(self.groups, found, strict=True)):
            h -= 1
        tables: list[list[int]] = []
        for g, f in zip(self.groups, found, strict=True):
            lo = g.window_start(h * bs)
            tables.append([g.null] * lo + [b for b in f[lo:h] if b is not None])
        return tables, keys[h - 1] if h else root

    @staticmethod
    def _holds(g: BlockManager, found: list[int | None], h: int) -> bool:
        """Whether the group holds what a hit of h blocks reads of it."""
        return all(b is not None for b in found[g.window_start(h * g.block_size) : h])

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_tokens: int | None = None,
        use_cache: bool = True,
        root: bytes | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> bool:
        n = len(token_ids) if num_tokens is None else num_tokens
        tables, _ = self._match(token_ids, root, images) if use_cache else ([[] for _ in self.groups], root)
        total = max(n, len(tables[0]) * self.block_size + 1)
        return all(g.can_adopt(t, total) for g, t in zip(self.groups, tables, strict=True))

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_tokens: int | None = None,
        use_cache: bool = True,
        root: bytes | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> int:
        """A new sequence's tables in every group; the tokens its prefix hit covers."""
        tables, last = (
            self._match(token_ids, root, images) if use_cache else ([[] for _ in self.groups], root)
        )
        cached = len(tables[0]) * self.block_size
        if use_cache:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += cached
        n = len(token_ids) if num_tokens is None else num_tokens
        done: list[BlockManager] = []
        try:
            for g, t in zip(self.groups, tables, strict=True):
                g.adopt(seq_id, t, last, root, max(n, cached + 1), images)
                done.append(g)
        except NoFreeBlocksError:
            for g in done:
                g.free(seq_id)
            raise
        return cached

    # -- a sequence's blocks in every group ------------------------------------------
    def ensure_slots(self, seq_id: int, total_tokens: int) -> bool:
        """Every group's table grown to hold `total_tokens`: all or nothing."""
        short = any(
            g.blocks_for(total_tokens) - len(g.block_tables[seq_id]) > g.num_free_blocks for g in self.groups
        )
        return not short and self._grow(seq_id, total_tokens)

    def reserve(self, seq_id: int, first_pos: int, total_tokens: int) -> bool:
        """Every group's blocks for `total_tokens` and its copies on write: all or nothing."""
        if any(g.reserve_need(seq_id, first_pos, total_tokens) > g.num_free_blocks for g in self.groups):
            return False
        return self._grow(seq_id, total_tokens)

    def _grow(self, seq_id: int, total_tokens: int) -> bool:
        grown = [g.ensure_slots(seq_id, total_tokens) for g in self.groups]  # each checked first
        return all(grown)

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        for g in self.groups:
            g.register_computed(seq_id, token_ids, num_computed)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(seq_id, num_tokens)

    def copy_on_write(self, seq_id: int, first_pos: int) -> list[tuple[int, int]]:
        """Every group's copies, in the one id space of the cache engine (`offsets`)."""
        return [
            (src + off, dst + off)
            for g, off in zip(self.groups, self.offsets, strict=True)
            for src, dst in g.copy_on_write(seq_id, first_pos)
        ]

    def fork(self, parent_id: int, child_id: int) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        for g in self.groups:
            g.free(seq_id)


#: what the scheduler and the engine hold: one group's manager, or one per group
KVManager = BlockManager | HybridBlockManager


def make_kv_manager(
    groups: Sequence[KVGroup], sizes: Sequence[int], block_size: int, watermark: float, caching: bool
) -> KVManager:
    """One block manager for a model of full attention, else one per KV group (a model
    windowed on every layer too: its prefix hits need only their last window, `_match`)."""
    if len(groups) == 1 and groups[0].window == 0:
        return BlockManager(sizes[0], block_size, watermark, caching)
    return HybridBlockManager(groups, sizes, block_size, watermark, caching)


def runner_tables(bm: KVManager) -> dict[int, list[int]] | list[dict[int, list[int]]]:
    """The block tables the model runner reads: one dict, or one per KV group."""
    if isinstance(bm, HybridBlockManager) and len(bm.groups) > 1:
        return bm.runner_tables
    return bm.block_tables


def kv_bytes_used(bm: KVManager, block_bytes: Sequence[int]) -> int:
    """The KV bytes the sequences hold now: each group's used blocks at its block's bytes."""
    groups = bm.groups if isinstance(bm, HybridBlockManager) else [bm]
    return sum(g.num_used_blocks * b for g, b in zip(groups, block_bytes, strict=True))
