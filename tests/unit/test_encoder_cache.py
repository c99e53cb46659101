"""The encoder cache (wsllm/engine/encoder_cache.py): bounded in bytes, least recently
used out first, never an entry a request still holds; hits and encoder runs counted; an
image under another tenant's root is another entry."""

from __future__ import annotations

import pytest
import torch

from wsllm.engine.encoder_cache import EncoderCache, key
from wsllm.prefix_hash import cache_root

ROWS = torch.zeros(4, 64)  # 1 KiB of float32 rows


def test_it_is_bounded_and_the_least_recently_used_goes_first() -> None:
    cache = EncoderCache(max_bytes=2 * 1024)
    cache.put("a", ROWS.clone())
    cache.put("b", ROWS.clone())
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", ROWS.clone())
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.stats.bytes == 2 * 1024 and cache.stats.evictions == 1
    assert (cache.stats.hits, cache.stats.runs) == (1, 3)
    assert cache.get("b") is None and cache.stats.hits == 1  # a miss: the encoder must run
    cache.put("huge", torch.zeros(16, 64))  # larger than the whole cache: used once, not kept
    assert "huge" not in cache and cache.stats.bytes <= 2 * 1024


def test_an_entry_a_request_holds_is_not_evicted_until_it_releases_it() -> None:
    cache = EncoderCache(max_bytes=1024)
    cache.put("a", ROWS.clone())
    cache.hold("a", "req-1")
    cache.put("b", ROWS.clone())  # no room without dropping a, which req-1 reads
    assert "a" in cache and "b" not in cache
    cache.release("req-1")
    cache.put("b", ROWS.clone())
    assert "a" not in cache and "b" in cache


def test_an_image_under_another_tenants_root_is_another_entry() -> None:
    digest = "c" * 64
    assert key(None, digest) == digest
    alice, bob = key(cache_root("alice"), digest), key(cache_root("bob"), digest)
    assert len({alice, bob, digest}) == 3


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0 bytes"):
        EncoderCache(-1)
