"""Prefix-aware routing on the Redis broker: a request goes to the engine that holds
the longest cached prefix of its prompt, so a conversation that resends its history
lands where that history's KV blocks are.

- Each engine publishes which prefix blocks it caches (`publish`: the first
  `SUMMARY_BYTES` of each block's chain key, packed, with its block size) when they
  change, at least once per heartbeat, under `{queue}:pfx:{engine}` with the
  heartbeat's TTL; `{queue}:pfxs` is the set of engines that did.
- A gateway (`PrefixRouter`) keeps the summaries of its models' engines, read again
  at most every `_REFRESH_S`, computes the prompt's keys with the engine's own hash
  chain (`wsllm.prefix_hash`) and names the engine with the longest run of leading
  blocks; the request waits in the queue marked for that engine (`redis_queue.py`),
  which takes it first. Any engine takes it after `steal_after_s`, so a busy or gone
  engine delays nobody for longer. No cached prefix anywhere: any engine takes it.

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

from wsllm.prefix_hash import SUMMARY_BYTES, prompt_keys

log = logging.getLogger(__name__)

_REFRESH_S = 0.05  # a gateway reads the summaries again at most this often
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


def publish(r: Any, queue: str, engine: str, block_size: int, keys: Sequence[bytes], ttl_ms: int) -> None:
    """Store an engine's summary (blocking redis-py, the engine's side)."""
    pipe = r.pipeline(transaction=False)
    pipe.set(summary_key(queue, engine), pack(block_size, keys), px=ttl_ms)
    pipe.sadd(queue + ":pfxs", engine)
    pipe.pexpire(queue + ":pfxs", ttl_ms)
    pipe.execute()


@dataclass(slots=True)
class _Summaries:
    at: float
    engines: dict[str, tuple[int, frozenset[bytes]]]


class PrefixRouter:
    """A gateway's routing by cached prefix (asyncio, redis.asyncio client)."""

    def __init__(self) -> None:
        self._cache: dict[str, _Summaries] = {}

    async def target(self, client: Any, queue: str, token_ids: Sequence[int]) -> str:
        """The engine holding the longest cached prefix of `token_ids`; '' when none
        holds any (any engine may take the request)."""
        engines = await self._summaries(client, queue)
        if len(engines) < 2:
            return ""
        best, best_len = [], 0
        by_size: dict[int, list[bytes]] = {}
        for engine, (block_size, held) in engines.items():
            keys = by_size.get(block_size)
            if keys is None:
                keys = by_size[block_size] = [k[:SUMMARY_BYTES] for k in prompt_keys(token_ids, block_size)]
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            tokens = n * block_size
            if tokens > best_len:
                best, best_len = [engine], tokens
            elif tokens == best_len and tokens > 0:
                best.append(engine)
        return random.choice(best) if best else ""

    async def _summaries(self, client: Any, queue: str) -> dict[str, tuple[int, frozenset[bytes]]]:
        cached = self._cache.get(queue)
        if cached is not None and time.monotonic() - cached.at < _REFRESH_S:
            return cached.engines
        names = sorted(
            m.decode() if isinstance(m, bytes) else str(m) for m in await client.smembers(queue + ":pfxs")
        )
        blobs = await client.mget([summary_key(queue, n) for n in names]) if names else []
        engines: dict[str, tuple[int, frozenset[bytes]]] = {}
        gone = []
        for name, blob in zip(names, blobs, strict=True):
            if blob is None:  # its engine stopped heartbeating
                gone.append(name)
                continue
            try:
                engines[name] = unpack(blob)
            except ValueError as e:
                log.warning("engine %s published a summary this gateway cannot read: %s", name, e)
        if gone:
            await client.srem(queue + ":pfxs", *gone)
        self._cache[queue] = _Summaries(time.monotonic(), engines)
        return engines
