"""Block manager: maps each sequence to fixed-size KV blocks.

Plain Python, no torch, so it is tested on a CPU in milliseconds. It owns a free
pool, one block table per sequence and a reference count per block. With prefix
caching on, every full block is keyed by a hash chain (SHA-256 over the parent's
key and the block's token ids); a block whose count drops to zero keeps its key
and sits in an LRU of reusable blocks until its memory is needed.

A manager serves one KV group (kv_groups.py): the layers that share its block tables. A group
of sliding-window layers (`window` W > 0) gives back, as a sequence computes, every block that
lies wholly before the next query's window (a query at p reads p - W + 1 .. p only): its table
keeps the entry's place, pointing at the group's null block (block 0, never handed out, never
written; no attention path reads a block before its window, kernels/paged_attention.py), so
positions still index the table as in a full group. A released block keeps its prefix-cache key,
so it may serve another sequence's hit (kv_groups.py says what a windowed hit needs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from wsllm.prefix_hash import ImageSpan, nth_key  # the one hash chain: routing computes it too


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        window: int = 0,
    ) -> None:
        if num_blocks < (2 if window > 0 else 1):
            raise ValueError(f"num_blocks must be >= {2 if window > 0 else 1}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # 0: full attention; W: the group's layers read a query's last W positions
        # a windowed group's placeholder for the blocks its window left behind (-1: none)
        self.null = 0 if window > 0 else -1
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # pop() gives the lowest first; a windowed group never hands out its null block
        self._free: list[int] = list(range(num_blocks - 1, self.null, -1))
        self._left: dict[int, int] = {}  # per windowed table: its leading entries given back
        # Prefix cache: key -> block, block -> key, and the evictable LRU (ref 0, key kept).
        self._cached: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.block_tables: dict[int, list[int]] = {}
        # Per table: how many leading blocks are hashed, and the chain key of the last of
        # them (None when it has to be rebuilt), so a newly full block costs one hash.
        self._hashed: dict[int, tuple[int, bytes | None]] = {}
        # Per table: the root its chain starts from (prefix_hash.cache_root: a namespace of its
        # own, such as a tenant's salt; None: the common root) and where its prompt's images'
        # placeholders are (the keys of the blocks holding them name them)
        self._chains: dict[int, tuple[bytes | None, Sequence[ImageSpan]]] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.num_cow = 0

    # -- capacity ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        """Every block a sequence may get (a windowed group's null block aside)."""
        return self.num_blocks - (self.null >= 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds now (what the KV bytes held count)."""
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)  # least recently used
            del self._cached[self._key_of.pop(b)]
        else:
            raise NoFreeBlocksError("no free KV block")
        assert self.ref_counts[b] == 0, f"block {b} handed out with ref {self.ref_counts[b]}"
        self.ref_counts[b] = 1
        return b

    def _release(self, b: int) -> None:
        if b == self.null:
            return
        if self.ref_counts[b] <= 0:
            raise AssertionError(f"double free of block {b}")
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # -- prefix cache -------------------------------------------------------
    def _match_prefix(
        self, token_ids: Sequence[int], root: bytes | None, images: Sequence[ImageSpan] = ()
    ) -> tuple[list[int], bytes | None]:
        """Cached blocks that hold a prefix of `token_ids` in the chain from `root`, and the
        chain key of the last of them (`root` when none). At least one token is left to
        compute so the model produces logits for the last one."""
        if not self.enable_prefix_caching:
            return [], root
        bs = self.block_size
        max_full = (len(token_ids) - 1) // bs
        parent = root
        hits: list[int] = []
        for i in range(max_full):
            key = nth_key(parent, token_ids, i, bs, images)
            b = self._cached.get(key)
            if b is None:
                break
            hits.append(b)
            parent = key
        return hits, parent

    def register_computed(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The sequence computed its first `num_computed` tokens: its blocks that are now full
        get keys (prefix caching), then a windowed group gives back those its window left."""
        if self.enable_prefix_caching:
            self._key_blocks(seq_id, token_ids, num_computed)
        if self.window > 0:
            self._slide(seq_id, num_computed)

    def _key_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        table = self.block_tables[seq_id]
        bs = self.block_size
        done, parent = self._hashed.get(seq_id, (0, None))
        full = min(num_computed // bs, len(table))
        if full <= done:
            return
        root, images = self._chains.get(seq_id, (None, ()))
        if parent is None:  # (re)build the chain from its root: a block may hold no key of its own
            parent = root
            for i in range(done):
                parent = nth_key(parent, token_ids, i, bs, images)
        for i in range(done, full):
            key = nth_key(parent, token_ids, i, bs, images)
            b = table[i]
            if b != self.null and key not in self._cached and b not in self._key_of:
                self._cached[key] = b
                self._key_of[b] = key
            parent = key
        self._hashed[seq_id] = (full, parent)

    def _slide(self, seq_id: int, num_computed: int) -> None:
        """Give back the blocks wholly before the next query's window: that query is at
        `num_computed` or later (a rejected draft is never computed), so it reads positions
        from num_computed - W + 1 on. Oldest first, so the LRU evicts them first."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        gone = min(max(0, num_computed - self.window + 1) // self.block_size, len(table))
        left = self._left.get(seq_id, 0)
        for i in range(left, gone):
            self._release(table[i])
            table[i] = self.null
        if gone > left:
            self._left[seq_id] = gone

    def lookup(self, key: bytes) -> int | None:
        """The cached block keyed `key`, if any."""
        return self._cached.get(key)

    def window_start(self, num_tokens: int) -> int:
        """The first table entry a query at position `num_tokens` reads (0: a full group)."""
        if self.window <= 0:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once when a step computes at
        most `chunk` of its tokens (a windowed group: its window and a chunk, every chunk's
        K and V are stored before its queries attend)."""
        full = self.blocks_for(num_tokens)
        if self.window <= 0:
            return full
        return min(full, self.blocks_for(self.window - 1 + chunk) + 1)

    def fits(self, num_tokens: int, chunk: int) -> bool:
        """Whether the cache could ever hold a sequence of `num_tokens` (the watermark kept)."""
        return self.peak_blocks(num_tokens, chunk) <= self.num_usable_blocks - self.watermark_blocks

    # -- sequences ---------------------------------------------------------
    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_tokens: int | None = None,
        use_cache: bool = True,
        root: bytes | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> bool:
        """Can a new sequence get blocks for its first `num_tokens` tokens (default all)?
        Keeps the watermark free for running decodes."""
        n = len(token_ids) if num_tokens is None else num_tokens
        hits, _ = self._match_prefix(token_ids, root, images) if use_cache else ([], None)
        return self.can_adopt(hits, max(n, len(hits) * self.block_size + 1))

    def can_adopt(self, hits: Sequence[int], total_tokens: int) -> bool:
        """Whether `adopt` of these hits and `total_tokens` leaves the watermark free."""
        needed = self.blocks_for(total_tokens) - len(hits)
        revived = sum(1 for b in hits if b != self.null and self.ref_counts[b] == 0)
        return self.num_free_blocks - revived - needed >= self.watermark_blocks

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_tokens: int | None = None,
        use_cache: bool = True,
        root: bytes | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> int:
        """Create the block table of a new sequence, its chain from `root` (None: the common
        one; `images`: its images' placeholders, in its blocks' keys). Returns how many
        leading tokens are already in the cache (prefix hits), which the engine need not
        compute. `use_cache=False`: no hits, every token is computed (its blocks are still
        offered to the cache once full)."""
        hits, last_key = self._match_prefix(token_ids, root, images) if use_cache else ([], root)
        cached = len(hits) * self.block_size
        if use_cache:  # the hit rate is over the prompts that looked
            self.queried_tokens += len(token_ids)
            self.hit_tokens += cached
        n = len(token_ids) if num_tokens is None else num_tokens
        self.adopt(seq_id, hits, last_key, root, max(n, cached + 1), images)
        return cached

    def adopt(
        self, seq_id: int, hits: Sequence[int], last_key: bytes | None, root: bytes | None, total_tokens: int,
        images: Sequence[ImageSpan] = (),
    ) -> None:  # fmt: skip
        """A new sequence's table: `hits` first (cached blocks of its prefix, whose last chain
        key is `last_key`; a windowed group's: the null block before its window), then new
        blocks up to `total_tokens`. All or nothing: NoFreeBlocksError leaves nothing."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        for b in hits:
            if b == self.null:
                continue
            if self.ref_counts[b] == 0:
                self._evictable.pop(b)
            self.ref_counts[b] += 1
        self.block_tables[seq_id] = list(hits)
        self._count_left(seq_id)
        self._hashed[seq_id] = (len(hits), last_key)
        self._chains[seq_id] = (root, images)
        if not self.ensure_slots(seq_id, total_tokens):
            self.free(seq_id)
            raise NoFreeBlocksError("not enough free KV blocks for the prompt")

    def _count_left(self, seq_id: int) -> None:
        """A windowed table's leading null entries (the blocks its window left behind)."""
        if self.window > 0:
            table = self.block_tables[seq_id]
            left = 0
            while left < len(table) and table[left] == self.null:
                left += 1
            self._left[seq_id] = left

    def ensure_slots(self, seq_id: int, total_tokens: int) -> bool:
        """Grow the table to hold `total_tokens`. All or nothing: False if short."""
        table = self.block_tables[seq_id]
        need = self.blocks_for(total_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens to the pool: those that held
        only rejected draft tokens (speculative decoding). They were never full and computed,
        so none of them is in the prefix cache."""
        table = self.block_tables[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def reserve_need(self, seq_id: int, first_pos: int, total_tokens: int) -> int:
        """New blocks for the sequence to hold `total_tokens` and write from `first_pos` on:
        its growth and the private copies of shared blocks there (copy_on_write)."""
        grow = max(0, self.blocks_for(total_tokens) - len(self.block_tables[seq_id]))
        return grow + self.cow_blocks_needed(seq_id, first_pos)

    def reserve(self, seq_id: int, first_pos: int, total_tokens: int) -> bool:
        """Blocks for `total_tokens`, with room for the copies on write: all or nothing."""
        if self.reserve_need(seq_id, first_pos, total_tokens) > self.num_free_blocks:
            return False
        return self.ensure_slots(seq_id, total_tokens)

    def cow_blocks_needed(self, seq_id: int, first_pos: int) -> int:
        table = self.block_tables[seq_id]
        return sum(1 for b in table[first_pos // self.block_size :] if self.ref_counts[b] > 1)

    def copy_on_write(self, seq_id: int, first_pos: int) -> list[tuple[int, int]]:
        """Before a sequence writes positions >= first_pos, give it private copies of
        shared blocks there. Returns (src, dst) block copies for the cache engine."""
        table = self.block_tables[seq_id]
        copies = []
        for i in range(first_pos // self.block_size, len(table)):
            b = table[i]
            if self.ref_counts[b] > 1:
                nb = self._take()
                self._release(b)
                table[i] = nb
                copies.append((b, nb))
                self.num_cow += 1
        done, _ = self._hashed.get(seq_id, (0, None))
        if first_pos // self.block_size < done:
            self._hashed[seq_id] = (first_pos // self.block_size, None)
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (reference counted)."""
        table = self.block_tables[parent_id]
        for b in table:
            if b != self.null:
                self.ref_counts[b] += 1
        self.block_tables[child_id] = list(table)
        if parent_id in self._left:
            self._left[child_id] = self._left[parent_id]
        self._hashed[child_id] = self._hashed.get(parent_id, (0, None))
        if parent_id in self._chains:
            self._chains[child_id] = self._chains[parent_id]

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id, None)
        self._hashed.pop(seq_id, None)
        self._left.pop(seq_id, None)
        self._chains.pop(seq_id, None)
        if table is None:
            return
        # Release tail first so the LRU evicts a chain's leaves before its root.
        for b in reversed(table):
            self._release(b)

    def take_blocks(self, n: int) -> list[int]:
        """Raw blocks for the caller (swap-in); all or nothing."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        return [self._take() for _ in range(n)]

    def set_table(
        self, seq_id: int, table: list[int], root: bytes | None = None, images: Sequence[ImageSpan] = ()
    ) -> None:
        """The table of a sequence swapped back in (its chain from `root`, its images')."""
        self.block_tables[seq_id] = table
        self._count_left(seq_id)
        self._hashed[seq_id] = (0, root)
        self._chains[seq_id] = (root, images)

    def check_invariants(self) -> None:
        """Reference counts equal the number of tables holding each block; every
        block is in exactly one of: used, free, evictable."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                if b != self.null:
                    counts[b] += 1
        assert counts == self.ref_counts, "reference counts do not match block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free list"
        ev = set(self._evictable)
        used = {b for b in range(self.num_blocks) if counts[b] > 0}
        assert not (free & ev) and not (free & used) and not (ev & used), "block in two pools"
        assert self.null not in free | ev, "the null block was handed out"
        assert len(free) + len(ev) + len(used) == self.num_usable_blocks, "a block is lost"
        assert set(self._cached.values()) == set(self._key_of), "cache maps disagree"

    def cached_keys(self, limit: int) -> list[bytes]:
        """The chain keys of the cached blocks, the `limit` most recently cached (what
        this engine tells the gateways it holds, for prefix-aware routing)."""
        keys = list(self._cached)
        return keys[-limit:] if limit > 0 else []

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
