"""Prefix-aware routing on the Redis broker: a request goes to the engine that holds
the longest cached prefix of its prompt, so a conversation that resends its history
lands where that history's KV blocks are.

- Each engine publishes which prefix blocks it caches (`publish`: the first
  `SUMMARY_BYTES` of each block's chain key, packed, with its block size) when they
  change, at least once per heartbeat, under `{queue}:pfx:{engine}` with the
  heartbeat's TTL, and stamps the new version in the hash `{queue}:pfxv`.
- A gateway (`PrefixRouter`) reads that small hash on every routing decision and
  fetches only the summaries that changed (a conversation's next turn comes right
  after its answer: it must see the blocks that answer cached), computes the prompt's
  keys with the engine's own hash chain (`wsllm.prefix_hash`) and names the engine
  with the longest run of leading blocks; the request waits in the queue marked for
  that engine (`redis_queue.py`), which takes it first. Another engine takes it once
  that engine is busy (it asked for no more, or stopped asking) and the request has
  waited `steal_after_s`. No cached prefix anywhere: any engine takes it.

A summary costs 8 bytes a block (16,384 blocks at most: 128 KiB); a clash of two
8-byte keys costs one routing miss, never a wrong answer (the engine matches full
keys).
"""

from __future__ import annotations

import logging
import random
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wsllm.prefix_hash import SUMMARY_BYTES, ImageSpan, prompt_keys

log = logging.getLogger(__name__)

_HEAD = struct.Struct(">I")  # the block size, before the keys


def pack(block_size: int, keys: Sequence[bytes]) -> bytes:
    return _HEAD.pack(block_size) + b"".join(k[:SUMMARY_BYTES] for k in keys)


def unpack(blob: bytes) -> tuple[int, frozenset[bytes]]:
    """(block size, key prefixes); ValueError when it is not a summary."""
    if len(blob) < _HEAD.size or (len(blob) - _HEAD.size) % SUMMARY_BYTES:
        raise ValueError(f"a prefix summary of {len(blob)} bytes")
    (block_size,) = _HEAD.unpack_from(blob)
    if block_size < 1:
        raise ValueError("a prefix summary with block size 0")
    body = memoryview(blob)[_HEAD.size :]
    return block_size, frozenset(
        bytes(body[i : i + SUMMARY_BYTES]) for i in range(0, len(body), SUMMARY_BYTES)
    )


def summary_key(queue: str, engine: str) -> str:
    return f"{queue}:pfx:{engine}"


def publish(
    r: Any, queue: str, engine: str, block_size: int, keys: Sequence[bytes], ttl_ms: int, versions_ttl: bool
) -> None:
    """Store an engine's summary (blocking redis-py, the engine's side); with
    `versions_ttl`, give the versions hash its TTL again (a few times per TTL is enough:
    every command counts against the tokens generated)."""
    pipe = r.pipeline(transaction=False)
    pipe.set(summary_key(queue, engine), pack(block_size, keys), px=ttl_ms)
    pipe.hset(queue + ":pfxv", engine, repr(time.time()))
    if versions_ttl:
        pipe.pexpire(queue + ":pfxv", ttl_ms)
    pipe.execute()


@dataclass(slots=True)
class _Summary:
    version: bytes
    block_size: int
    held: frozenset[bytes]


class PrefixRouter:
    """A gateway's routing by cached prefix (asyncio, redis.asyncio client)."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[str, _Summary]] = {}  # queue -> engine -> its summary

    async def target(
        self,
        client: Any,
        queue: str,
        token_ids: Sequence[int],
        root: bytes | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> str:
        """The engine holding the longest cached prefix of `token_ids` in the namespace
        whose chains start at `root` (`prefix_hash.request_root`: the engine files the
        request's blocks under the same), its images' placeholders at `images`
        (`prefix_hash.request_images`: the keys of the blocks holding them name them); '' when none holds any (any engine may take it)."""
        engines = await self._summaries(client, queue)
        if len(engines) < 2:
            return ""
        best, best_len = [], 0
        by_size: dict[int, list[bytes]] = {}
        for engine, summary in engines.items():
            block_size, held = summary.block_size, summary.held
            keys = by_size.get(block_size)
            if keys is None:
                keys = by_size[block_size] = [
                    k[:SUMMARY_BYTES] for k in prompt_keys(token_ids, block_size, root, images)
                ]
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            tokens = n * block_size
            if tokens > best_len:
                best, best_len = [engine], tokens
            elif tokens == best_len and tokens > 0:
                best.append(engine)
        return random.choice(best) if best else ""

    async def _summaries(self, client: Any, queue: str) -> dict[str, _Summary]:
        """The live engines' summaries, fetching those whose version moved."""
        versions = {
            (k.decode() if isinstance(k, bytes) else str(k)): bytes(v)
            for k, v in (await client.hgetall(queue + ":pfxv")).items()
        }
        known = self._cache.setdefault(queue, {})
        for gone in set(known) - set(versions):
            del known[gone]
        stale = sorted(e for e, v in versions.items() if e not in known or known[e].version != v)
        blobs = await client.mget([summary_key(queue, e) for e in stale]) if stale else []
        dead = []
        for engine, blob in zip(stale, blobs, strict=True):
            known.pop(engine, None)
            if blob is None:  # its engine stopped heartbeating: the summary expired
                dead.append(engine)
                continue
            try:
                known[engine] = _Summary(versions[engine], *unpack(blob))
            except ValueError as e:
                log.warning("engine %s published a summary this gateway cannot read: %s", engine, e)
        if dead:
            await client.hdel(queue + ":pfxv", *dead)
        return known
