"""The gateway side of the Redis broker: redis.asyncio on the app's event loop.

The reader (`events()`) follows the result streams of this gateway's live requests
with one blocking `XREAD` over all of them plus the gateway's wake-up stream (a new
request, or a resume, wakes it). It checks every event's `seq` per choice, so a
duplicate (a retried publish) is dropped and a gap ends the request with
`worker_lost` instead of wrong text. An entry it cannot read ends its own request
with `worker_lost` and nothing else. When Redis comes back after an outage it checks
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

from wsllm.broker import redis_queue
from wsllm.broker.base import BrokerClosed, BrokerUnavailable, QueueFull, Resumable
from wsllm.broker.fair_queue import tenant_cap
from wsllm.broker.prefix_routing import PrefixRouter
from wsllm.broker.redis_keys import ABORT, ENGINES, GROUP, UNAVAILABLE, Keys, client_options
from wsllm.config import RedisConfig
from wsllm.types import EngineInfo, GenerateRequest, TokenEvent, WireError
from wsllm.wire import decode_events, encode

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


class GatewaySide:
    def __init__(
        self,
        url: str,
        keys: Keys,
        cfg: RedisConfig,
        model: str,
        max_queue_depth: int,
        max_queue_share: float = 1.0,
    ) -> None:
        self.url = url
        self.keys = keys
        self.cfg = cfg
        self.model = model
        self.max_queue_depth = max_queue_depth
        self.tenant_cap = tenant_cap(max_queue_depth, max_queue_share)
        self.router = PrefixRouter() if cfg.routing == "prefix" else None
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.wake_key = keys.wake(self.gateway_id)
        self.closed = False
        # One client per event loop: tests run several loops, and a client is bound to one.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = (
            weakref.WeakKeyDictionary()
        )
        self._follows: dict[str, _Follow] = {}
        # request id -> (its waiting stream, its entry id there), until its first event
        self._queued: dict[str, tuple[str, str]] = {}
        self._positions: dict[str, int] = {}
        self._positions_at = 0.0
        self._engines: tuple[float, list[EngineInfo]] = (0.0, [])

    def client(self) -> Any:  # redis-py's reply types are too loose to be useful here
        loop = asyncio.get_running_loop()
        r = self._clients.get(loop)
        if r is None:
            r = self._clients[loop] = aioredis.Redis.from_url(
                self.url, **client_options(self.cfg, asyncio=True)
            )
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
        context: dict[str, Any] | None,
        target: str = "",
    ) -> None:
        """Queue `request` (for engine `target` first, when routed: `redis_queue.py`)."""
        if self.closed:
            raise BrokerClosed("the broker is closed")
        rid = request.request_id
        model = request.model or self.model
        meta = orjson.dumps({"ctx": context or {}, "n": request.params.n, "model": model})
        keys = [self.keys.queue(model), self.keys.out(rid), self.wake_key]
        if not target and self.router is not None:
            try:
                target = await self.router.target(self.client(), keys[0], request.prompt_token_ids)
            except UNAVAILABLE as e:
                raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        self._follows[rid] = _Follow(n=request.params.n)  # before it can have events
        ttl_ms = int(self.cfg.request_ttl_s * 1000)
        try:
            args = redis_queue.submit_args(
                GROUP, self.max_queue_depth, self.tenant_cap, encode(request), meta, ttl_ms, rid,
                request.queue_deadline, request.priority, request.tenant, target,
            )  # fmt: skip
            ok, value, where = await self._call(redis_queue.SUBMIT, keys, args)
        except BaseException:
            self._follows.pop(rid, None)
            raise
        if not ok:
            self._follows.pop(rid, None)
            if where == b"tenant":
                raise QueueFull(
                    f"{value} requests of this tenant are already waiting (its share of the queue)"
                )
            raise QueueFull(f"{value} requests are already waiting for an engine")
        self._queued[rid] = (value.decode(), where.decode())

    async def abort(self, request_id: str, attach: int | None = None, keep: bool = True) -> bool:
        """Abort; with `attach`, only if no client resumed the request since then. With
        `keep` False its result stream goes at once (its resume token then names nothing)
        instead of staying resumable for the retention time."""
        self.forget(request_id)
        marker = encode([TokenEvent.abort_marker(request_id)])
        keys = [self.keys.out(request_id), self.keys.aborts, self.keys.attached(request_id)]
        retention = int(self.cfg.stream_retention_s * 1000) if keep else 0  # PEXPIRE 0 deletes
        args = [request_id, retention, marker, self.cfg.aborts_maxlen, "" if attach is None else str(attach)]
        return bool(await self._call(ABORT, keys, args) == 1)

    async def ping(self, timeout: float) -> bool:
        """Whether Redis answers a PING within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                return bool(await self.client().ping())
        except (TimeoutError, *UNAVAILABLE):
            return False

    # -- resume --------------------------------------------------------------------------

    async def lookup(self, request_id: str) -> Resumable | None:
        try:
            first = await self.client().xrange(self.keys.out(request_id), count=1)
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        if not first or b"m" not in first[0][1]:
            return None
        try:
            ctx = orjson.loads(first[0][1][b"m"]).get("ctx")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return Resumable(request_id, ctx) if isinstance(ctx, dict) else None

    async def follow(self, request_id: str) -> int:
        """Read the request's stream from its start; count the attach (the grace abort
        of the client that left before is off). Returns the new attach count."""
        self._follows[request_id] = _Follow()
        pipe = self.client().pipeline(transaction=False)
        pipe.incr(self.keys.attached(request_id))
        pipe.pexpire(self.keys.attached(request_id), int(self.cfg.request_ttl_s * 1000))
        pipe.xadd(self.wake_key, {"x": "1"}, maxlen=1, approximate=False)
        try:
            attach, _, _ = await pipe.execute()
        except UNAVAILABLE as e:
            self._follows.pop(request_id, None)
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        return int(attach)

    def forget(self, request_id: str) -> None:
        self._follows.pop(request_id, None)
        self._queued.pop(request_id, None)
        self._positions.pop(request_id, None)

    # -- the reader ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        reader: Any = aioredis.Redis.from_url(
            self.url,
            single_connection_client=True,
            **client_options(self.cfg, asyncio=True, wait_s=_READ_BLOCK_MS / 1000),
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
            try:
                events = self._entry_events(f, fields)
            except (WireError, orjson.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
                # One bad entry ends its own request, and nothing else.
                log.error("unreadable entry %s of %s: %s", entry_id, rid, e)
                out.append(TokenEvent.lost(rid, "the engine sent an event this gateway cannot read"))
                self.forget(rid)
                return out
            if events:
                self._queued.pop(rid, None)
            for raw in events:
                ev = self._checked(rid, f, raw)
                if ev is None:
                    continue
                out.append(ev)
                if ev.ends_request or len(f.done) >= f.n:
                    self.forget(rid)
                    return out
        return out

    @staticmethod
    def _entry_events(f: _Follow, fields: dict[bytes, bytes]) -> list[TokenEvent]:
        """The events of one result-stream entry (the meta entry has none)."""
        if b"m" in fields:
            n = orjson.loads(fields[b"m"]).get("n", 1)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"bad choice count {n!r}")
            f.n = n
        if b"e" not in fields:
            return []
        return decode_events(fields[b"e"])

    @staticmethod
    def _checked(rid: str, f: _Follow, ev: TokenEvent) -> TokenEvent | None:
        """Drop duplicates and events of another request; turn a gap into worker_lost."""
        if ev.request_id != rid:
            return None
        if ev.seq >= 0 and not ev.ends_request and not ev.whole_request:
            want = f.next_seq.get(ev.index, 0)
            if ev.seq < want:
                return None
            if ev.seq > want:
                return TokenEvent.lost(rid, f"events {want}..{ev.seq - 1} of this request were lost")
            f.next_seq[ev.index] = want + 1
        if ev.finish_reason is not None and not ev.whole_request:
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
                lost.append(TokenEvent.lost(rid, "the broker restarted and lost this request"))
        return lost

    # -- registry and queue ----------------------------------------------------------------

    async def tokenizer_files(self, model: str) -> dict[str, bytes] | None:
        try:
            got = await self.client().hgetall(self.keys.tokenizer(model))
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        if not got:
            return None
        return {(k.decode() if isinstance(k, bytes) else str(k)): bytes(v) for k, v in got.items()}

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
            try:
                info = EngineInfo.from_dict(orjson.loads(raw))
            except (orjson.JSONDecodeError, TypeError, ValueError):
                log.warning("an engine heartbeat this gateway cannot read: %r", raw[:200])
                continue
            info.last_seen = now - max(0.0, ttl_ms - int(pttl)) / 1000  # Redis's clock, not the engine's
            infos.append(info)
        self._engines = (time.monotonic(), infos)
        return infos

    def invalidate_engines(self) -> None:
        self._engines = (0.0, [])

    async def pending(self) -> int:
        try:
            return max(
                0, int(await self.client().eval(redis_queue.COUNT, 1, self.keys.queue(self.model), GROUP))
            )
        except (*UNAVAILABLE, redis.exceptions.ResponseError):
            return 0

    async def position(self, request_id: str) -> int | None:
        if request_id not in self._queued:
            return 0 if request_id in self._follows else None
        if time.monotonic() - self._positions_at >= self.cfg.queue_poll_s / 2:
            self._positions_at = time.monotonic()
            queued = list(self._queued.items())
            flat = [part for _, where in queued for part in where]
            try:
                places = await self.client().eval(
                    redis_queue.POSITIONS, 1, self.keys.queue(self.model), _POSITION_SCAN, *flat
                )
            except UNAVAILABLE:
                return None
            self._positions = {rid: int(p) for (rid, _), p in zip(queued, places, strict=True)}
        return self._positions.get(request_id)

    async def aclose(self) -> None:
        r = self._clients.pop(asyncio.get_running_loop(), None)
        if r is not None:
            await r.aclose()
