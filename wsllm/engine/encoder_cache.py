"""The encoder cache: an image's encoder output (the rows its placeholder tokens take in
the text model, on the model's device) kept by the image, so that an image seen again
does not run the encoder again (docs/vision.md). Plain Python over tensors.

An entry is keyed by the image's digest under its request's prefix-cache root
(`key`): the same namespace rule as the KV blocks, so that one tenant's image never
spares another's encoder run (a timing that would tell it was sent). The cache is
bounded in bytes; the least recently used entry goes first, except an entry a request
still holds (`hold` .. `release`: its prompt's placeholders are not all computed yet,
as a chunked prefill may split them), so what is in use is never dropped: a held entry
is kept even past the bound until it is released. Hits and encoder runs are counted
(`stats`, the engine's stats). Its size is `--encoder-cache-mb`."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0  # images served from the cache
    runs: int = 0  # images the encoder ran for (each a miss)
    evictions: int = 0
    bytes: int = 0  # held now


def key(root: bytes | None, digest: str) -> str:
    """An image's entry: its digest under its request's root (prefix_hash.request_root)."""
    return digest if root is None else hashlib.sha256(root + digest.encode()).hexdigest()


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the encoder cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = EncoderCacheStats()
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self._holders: dict[str, set[str]] = {}  # entry -> the requests holding it

    def counts(self) -> dict[str, int]:
        """EngineStats' encoder fields."""
        s = self.stats
        return {"encoder_runs": s.runs, "encoder_hits": s.hits, "encoder_cache_bytes": s.bytes}

    @property
    def num_held(self) -> int:
        """Entries some request holds now."""
        return len(self._holders)

    def __contains__(self, k: str) -> bool:
        return k in self._rows

    def get(self, k: str) -> torch.Tensor | None:
        """An image's rows (counted a hit), or None: the encoder must run."""
        rows = self._rows.get(k)
        if rows is not None:
            self._rows.move_to_end(k)
            self.stats.hits += 1
        return rows

    def put(self, k: str, rows: torch.Tensor) -> None:
        """The encoder's output for an image it just ran for (counted a run), kept while
        room can be made for it."""
        self.stats.runs += 1
        size = rows.numel() * rows.element_size()
        if k in self._rows:
            return
        self._make_room(size)
        if self.stats.bytes + size > self.max_bytes and k not in self._holders:
            return  # larger than what can be freed: used once, not kept
        self._rows[k] = rows
        self.stats.bytes += size

    def hold(self, k: str, request_id: str) -> None:
        """`request_id` reads entry `k` until it releases it: it is not evicted meanwhile."""
        self._holders.setdefault(k, set()).add(request_id)

    def release(self, request_id: str) -> None:
        """Every entry `request_id` held may go again (its prompt is computed, or it left)."""
        for k in [k for k, who in self._holders.items() if request_id in who]:
            self._holders[k].discard(request_id)
            if not self._holders[k]:
                del self._holders[k]

    def _make_room(self, size: int) -> None:
        for k in list(self._rows):
            if self.stats.bytes + size <= self.max_bytes:
                return
            if k in self._holders:
                continue
            rows = self._rows.pop(k)
            self.stats.bytes -= rows.numel() * rows.element_size()
            self.stats.evictions += 1
