"""The gateway side of the Redis broker: redis.asyncio on the app's event loop.

The reader (`events()`) follows the result streams of this gateway's live requests
with one blocking `XREAD` over all of them plus the gateway's wake-up stream (a new
request, or a resume, wakes it). It checks every event's `seq` per choice, so a
duplicate (a retried publish) is dropped and a gap ends the request with
`worker_lost` instead of wrong text. When Redis comes back after an outage it checks
that each followed request still exists (Redis may have restarted empty) and ends
those that do not.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
import redis.exceptions

from wsllm.broker.base import BrokerClosed, BrokerUnavailable, EngineInfo, QueueFull, Resumable
from wsllm.broker.redis_keys import (
    ABORT,
    ENGINES,
    GROUP,
    POSITIONS,
    SUBMIT,
    UNAVAILABLE,
    Keys,
    client_options,
)
from wsllm.config import RedisConfig
from wsllm.types import FINISH_ABORT, FINISH_ERROR, GenerateRequest, TokenEvent, decode, encode

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 1000  # the reader re-checks close() at least this often
_ENGINES_CACHE_S = 0.25
_POSITION_SCAN = 10000


@dataclass(slots=True)
class _Follow:
    """A request whose result stream this gateway reads."""

    last_id: str = "0-0"
    n: int = 1
    next_seq: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


def _lost(rid: str, why: str) -> TokenEvent:
    return TokenEvent(rid, -1, [], finish_reason=FINISH_ERROR, error=why, error_code="worker_lost")


class GatewaySide:
    def __init__(self, url: str, keys: Keys, cfg: RedisConfig, model: str, max_waiting: int) -> None:
        self.url = url
        self.keys = keys
        self.cfg = cfg
        self.model = model
        self.max_waiting = max_waiting
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.wake_key = keys.wake(self.gateway_id)
        self.closed = False
        # One client per event loop: tests run several loops, and a client is bound to one.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
            weakref.WeakKeyDictionary()
        )
        self._follows: dict[str, _Follow] = {}
        self._queued: dict[str, str] = {}  # request id -> its entry id, until its first event
        self._positions: dict[str, int] = {}
        self._positions_at = 0.0
        self._engines: tuple[float, list[EngineInfo]] = (0.0, [])

    def client(self) -> Any:  # redis-py's reply types are too loose to be useful here
        loop = asyncio.get_running_loop()
        r = self._clients.get(loop)
        if r is None:
            r = self._clients[loop] = aioredis.Redis.from_url(self.url, **client_options(asyncio=True))
        return r

    async def _call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client().eval(script, len(keys), *keys, *args)
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None

    # -- submit and abort ----------------------------------------------------------------

    async def submit(
        self,
        request: GenerateRequest,
        max_waiting: int | None,
        context: dict[str, Any] | None,
        alias: str | None,
    ) -> None:
        if self.closed:
            raise BrokerClosed("the broker is closed")
        rid = request.request_id
        model = request.model or self.model
        meta = orjson.dumps({"ctx": context or {}, "n": request.params.n, "model": model})
        keys = [self.keys.queue(model), self.keys.out(rid), self.wake_key]
        if alias:
            keys.append(self.keys.alias(alias))
        self._follows[rid] = _Follow(n=request.params.n)  # before it can have events
        cap = self.max_waiting if max_waiting is None else max_waiting
        ttl_ms = int(self.cfg.request_ttl_s * 1000)
        try:
            ok, value = await self._call(SUBMIT, keys, [GROUP, cap, encode(request), meta, ttl_ms, rid])
        except BaseException:
            self._follows.pop(rid, None)
            raise
        if not ok:
            self._follows.pop(rid, None)
            raise QueueFull(f"{value} requests are already waiting for an engine")
        self._queued[rid] = value.decode()

    async def abort(self, request_id: str, unless_resumed: bool = False) -> bool:
        self.forget(request_id)
        marker = encode([TokenEvent(request_id, -1, [], index=-1, finish_reason=FINISH_ABORT)])
        keys = [self.keys.out(request_id), self.keys.aborts, self.keys.resumed(request_id)]
        retention = int(self.cfg.stream_retention_s * 1000)
        args = [request_id, retention, marker, self.cfg.aborts_maxlen, "1" if unless_resumed else "0"]
        return bool(await self._call(ABORT, keys, args) == 1)

    # -- resume --------------------------------------------------------------------------

    async def lookup(self, key: str) -> Resumable | None:
        r = self.client()
        try:
            rid = await r.get(self.keys.alias(key))
            rid = rid.decode() if rid is not None else key
            first = await r.xrange(self.keys.out(rid), count=1)
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        if not first or b"m" not in first[0][1]:
            return None
        meta = orjson.loads(first[0][1][b"m"])
        return Resumable(rid, meta.get("ctx") or {})

    async def follow(self, request_id: str) -> None:
        """Read the request's stream from its start; mark it resumed (no grace abort)."""
        self._follows[request_id] = _Follow()
        pipe = self.client().pipeline(transaction=False)
        pipe.set(self.keys.resumed(request_id), "1", px=int(self.cfg.request_ttl_s * 1000))
        pipe.xadd(self.wake_key, {"x": "1"}, maxlen=1, approximate=False)
        try:
            await pipe.execute()
        except UNAVAILABLE as e:
            self._follows.pop(request_id, None)
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None

    def forget(self, request_id: str) -> None:
        self._follows.pop(request_id, None)
        self._queued.pop(request_id, None)
        self._positions.pop(request_id, None)

    # -- the reader ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        reader: Any = aioredis.Redis.from_url(
            self.url, single_connection_client=True, **client_options(asyncio=True)
        )
        wake_id = "$"
        broken = False
        try:
            while not self.closed:
                # The follow state each read is for: a resume may replace it meanwhile, and
                # then this read's entries are not for the new reader of that request.
                reading = {self.keys.out(r): (r, f) for r, f in self._follows.items()}
                streams = {self.wake_key: wake_id} | {k: f.last_id for k, (_, f) in reading.items()}
                try:
                    if wake_id == "$":  # resolve "$" once, or a wake-up between reads would be missed
                        last = await reader.xrevrange(self.wake_key, count=1)
                        wake_id = streams[self.wake_key] = last[0][0].decode() if last else "0-0"
                    resp = await reader.xread(streams, block=_READ_BLOCK_MS)
                    if broken:
                        broken = False
                        log.warning("redis is back; checking %d followed requests", len(self._follows))
                        lost = await self._check_followed()
                        if lost:
                            yield lost
                except UNAVAILABLE as e:
                    if not broken:
                        log.warning("redis unreachable (%s); the reader retries", e)
                    broken = True
                    await asyncio.sleep(0.5)
                    continue
                except redis.exceptions.RedisError:  # never let the reader die: /ready depends on it
                    log.exception("reading result streams failed; retrying")
                    await asyncio.sleep(0.5)
                    continue
                batch: list[TokenEvent] = []
                for key, entries in resp or []:
                    key = key.decode()
                    if key == self.wake_key:
                        wake_id = entries[-1][0].decode()
                        continue
                    if key in reading:
                        batch.extend(self._take(*reading[key], entries))
                if batch:
                    yield batch
        finally:
            await reader.aclose()

    def _take(self, rid: str, f: _Follow, entries: list[Any]) -> list[TokenEvent]:
        if self._follows.get(rid) is not f:  # forgotten, or followed anew (a resume), meanwhile
            return []
        out: list[TokenEvent] = []
        for entry_id, fields in entries:
            f.last_id = entry_id.decode()
            if b"m" in fields:
                f.n = int(orjson.loads(fields[b"m"]).get("n", 1))
            if b"e" not in fields:
                continue
            self._queued.pop(rid, None)
            try:
                events = decode(fields[b"e"])
                assert isinstance(events, list)
            except Exception:
                log.exception("undecodable entry %s of %s", entry_id, rid)
                out.append(_lost(rid, "the engine sent an event this gateway cannot read"))
                self.forget(rid)
                return out
            for raw in events:
                ev = self._checked(rid, f, raw)
                if ev is None:
                    continue
                out.append(ev)
                if ev.finish_reason == FINISH_ERROR or ev.index < 0 or len(f.done) >= f.n:
                    self.forget(rid)
                    return out
        return out

    @staticmethod
    def _checked(rid: str, f: _Follow, ev: TokenEvent) -> TokenEvent | None:
        """Drop duplicates; turn a gap into worker_lost."""
        if ev.seq >= 0 and ev.index >= 0 and ev.finish_reason != FINISH_ERROR:
            want = f.next_seq.get(ev.index, 0)
            if ev.seq < want:
                return None
            if ev.seq > want:
                return _lost(rid, f"events {want}..{ev.seq - 1} of this request were lost")
            f.next_seq[ev.index] = want + 1
        if ev.finish_reason is not None and ev.index >= 0:
            f.done.add(ev.index)
        return ev

    async def _check_followed(self) -> list[TokenEvent]:
        """After an outage: end the followed requests that Redis no longer knows."""
        rids = list(self._follows)
        if not rids:
            return []
        pipe = self.client().pipeline(transaction=False)
        for rid in rids:
            pipe.xrange(self.keys.out(rid), count=1)
        lost = []
        for rid, first in zip(rids, await pipe.execute(), strict=True):
            if not first or b"m" not in first[0][1]:
                self.forget(rid)
                lost.append(_lost(rid, "the broker restarted and lost this request"))
        return lost

    # -- registry and queue ----------------------------------------------------------------

    async def engines(self) -> list[EngineInfo]:
        at, cached = self._engines
        if time.monotonic() - at < _ENGINES_CACHE_S:
            return cached
        try:
            flat = await self.client().eval(ENGINES, 1, self.keys.engines, self.keys.engine(""))
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        now = time.time()
        ttl_ms = self.cfg.engine_ttl_s * 1000
        infos = []
        for raw, pttl in zip(flat[::2], flat[1::2], strict=True):
            info = EngineInfo.from_dict(orjson.loads(raw))
            info.last_seen = now - max(0.0, ttl_ms - int(pttl)) / 1000  # Redis's clock, not the engine's
            infos.append(info)
        self._engines = (time.monotonic(), infos)
        return infos

    def invalidate_engines(self) -> None:
        self._engines = (0.0, [])

    async def pending(self) -> int:
        q = self.keys.queue(self.model)
        try:
            pipe = self.client().pipeline(transaction=False)
            pipe.xlen(q)
            pipe.xpending(q, GROUP)
            size, pend = await pipe.execute(raise_on_error=False)
        except UNAVAILABLE:
            return 0
        if isinstance(size, Exception) or isinstance(pend, Exception):
            return 0
        return max(0, int(size) - int(pend["pending"]))

    async def position(self, request_id: str) -> int | None:
        if request_id not in self._queued:
            return 0 if request_id in self._follows else None
        if time.monotonic() - self._positions_at >= self.cfg.queue_poll_s / 2:
            self._positions_at = time.monotonic()
            queued = sorted(self._queued.items(), key=lambda kv: kv[1])
            try:
                places = await self.client().eval(
                    POSITIONS, 1, self.keys.queue(self.model), GROUP, _POSITION_SCAN, *[e for _, e in queued]
                )
            except UNAVAILABLE:
                return None
            self._positions = {rid: int(p) for (rid, _), p in zip(queued, places, strict=True)}
        return self._positions.get(request_id)

    async def aclose(self) -> None:
        r = self._clients.pop(asyncio.get_running_loop(), None)
        if r is not None:
            await r.aclose()
