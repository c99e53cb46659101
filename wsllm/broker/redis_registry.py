"""The engine registry: written by each engine's side (`Registry`, which
`redis_engine.RedisEngine` hands its calls on to), read by gateways (`RegistryReader`).

The engine side: the heartbeat (the engine's registry key, and a few times per lease the refresh of
the entries it holds), the published tokenizer, deregistering, and handing requests
back to the queue on shutdown. It reads and drops from the engine's table of held
requests (`redis_held.py`), which it is given."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import orjson
import redis.exceptions

from wsllm.broker.base import MAX_TOKENIZER_BYTES, STALL_HANDOFFS, TOKENIZER_FILES
from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_held import HeldRequests
from wsllm.broker.redis_keys import GROUP, UNAVAILABLE, Keys
from wsllm.broker.redis_queue import counters_key, wake_key
from wsllm.broker.redis_scripts import ENGINES, REFRESH, TOKENIZER_READ
from wsllm.config_redis import RedisConfig
from wsllm.types import EngineInfo
from wsllm.wire import encode

log = logging.getLogger(__name__)

#: a gateway reads the registry at most this often (seconds)
ENGINES_CACHE_S = 1.0
# A model's published tokenizer outlives its last engine by this much (milliseconds).
_TOKENIZER_TTL_MS = 24 * 3600 * 1000
# The field of a published tokenizer that holds its files' digest (no tokenizer file is named so).
_DIGEST = "_sha256"


class Registry:
    def __init__(
        self, r: Any, keys: Keys, cfg: RedisConfig, model: str, consumer: str, held: HeldRequests
    ) -> None:
        self.r: Any = r  # redis-py's reply types are too loose to be useful here
        self.keys, self.cfg, self.model, self.consumer = keys, cfg, model, consumer
        self.queue = keys.queue(model)
        self.held = held
        self._refresh = r.register_script(REFRESH)
        self._next_refresh = 0.0
        self._next_registry = 0.0

    # -- registry and leases -----------------------------------------------------------

    def heartbeat(self, info: EngineInfo) -> None:
        d = info.to_dict() | {"last_seen": time.time()}
        ttl_ms = int(self.cfg.engine_ttl_s * 1000)
        owned = self.held.owned()
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.keys.engine(info.engine_id), orjson.dumps(d), px=ttl_ms)
            if time.monotonic() >= self._next_registry:  # the set and the tokenizer's TTL need less
                self._next_registry = time.monotonic() + self.cfg.engine_ttl_s / 4
                pipe.sadd(self.keys.engines, info.engine_id)
                pipe.pexpire(self.keys.tokenizer(self.model), _TOKENIZER_TTL_MS)
            pipe.execute()
            # Refreshing the leases a few times per lease is enough (and cheap).
            if owned and self.held.started and time.monotonic() >= self._next_refresh:
                self._next_refresh = time.monotonic() + self.cfg.lease_s / 4
                args = [GROUP, self.consumer, 2 * len(owned) + 1000, *owned]
                lost = self._refresh(keys=[self.queue], args=args)
                for entry_id in lost or []:
                    rid = owned[entry_id.decode() if isinstance(entry_id, bytes) else entry_id]
                    log.warning("%s: lost its lease on %s; stopping it here", self.consumer, rid)
                    self.held.drop(rid)
        except UNAVAILABLE as e:
            log.debug("redis unavailable for the heartbeat (%s)", e)
        except redis.exceptions.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            for rid in owned.values():  # the group (and our entries) are gone: Redis restarted
                self.held.drop(rid)

    def publish_tokenizer(self, files: dict[str, bytes]) -> None:
        """Store this model's tokenizer files for the gateways (kept while any engine of
        the model heartbeats, then for a day), with their digest (`_DIGEST`): an engine
        that starts again finds the same files there and only refreshes their TTL, instead
        of writing megabytes again at every restart (Redis's memory jumps with each)."""
        key = self.keys.tokenizer(self.model)
        digest = hashlib.sha256(b"".join(n.encode() + b"\0" + files[n] for n in sorted(files))).hexdigest()
        if files and self.r.hget(key, _DIGEST) == digest.encode():
            self.r.pexpire(key, _TOKENIZER_TTL_MS)
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        if files:
            pipe.hset(key, mapping={**files, _DIGEST: digest})
            pipe.pexpire(key, _TOKENIZER_TTL_MS)
        pipe.execute()

    def deregister(self, engine_id: str) -> None:
        self._next_registry = 0.0  # a heartbeat after this one registers it again at once
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.delete(self.keys.engine(engine_id))
            pipe.srem(self.keys.engines, engine_id)
            pipe.execute()
            if self.held.started and not self.held.by_id:
                pending = self.r.xpending_range(self.queue, GROUP, "-", "+", 1, consumername=self.consumer)
                if not pending:
                    self.r.xgroup_delconsumer(self.queue, GROUP, self.consumer)
        except UNAVAILABLE as e:
            log.warning("redis unavailable while deregistering (%s)", e)
        except redis.exceptions.ResponseError:
            pass

    def release(self, request_ids: list[str], stalled: bool = False) -> list[str]:
        """Re-queue held requests (marked `h`: their result streams are checked when
        they are pulled again; counted as waiting until a take delivers them; with their
        deliveries so far, `dv`, and, `x`, the stalled engines that held them, this one
        too when `stalled`) and ack the old entries, atomically per request; then wake the
        model's engines. A stalled engine keeps what a stalled engine handed on before."""
        left = []
        for rid in request_ids:
            held = self.held.get(rid)
            if held is None or held.dropped or (stalled and held.stalls >= STALL_HANDOFFS):
                left.append(rid)
                continue
            marks = {"dv": held.deliveries, "x": held.stalls + stalled}
            fields = {"r": encode(held.request), "h": "1", "s": held.results, "st": held.start} | marks
            pipe = self.r.pipeline(transaction=True)
            pipe.xadd(self.queue, fields)
            pipe.xack(self.queue, GROUP, held.entry_id)
            pipe.xdel(self.queue, held.entry_id)
            pipe.hincrby(counters_key(self.queue), "h", 1)
            pipe.xadd(wake_key(self.queue), {"x": "1"}, maxlen=1, approximate=False)
            try:
                pipe.execute()
            except UNAVAILABLE:
                left.append(rid)
                continue
            held.dropped = True
            log.info("%s: handed %s back to the queue", self.consumer, rid)
        return left


class RegistryReader:
    """The registry as a gateway reads it (redis.asyncio, `client()` gives the loop's
    client): the live engines, from a copy cached for `ENGINES_CACHE_S`, and a model's
    published tokenizer. `unavailable(e)` is the gateway's error for an unreachable
    Redis (it also drops this cache: /ready must not report engines it cannot see)."""

    def __init__(
        self,
        client: Callable[[], Any],
        keys: Keys,
        cfg: RedisConfig,
        unavailable: Callable[[BaseException], Exception],
    ) -> None:
        self.client, self.keys, self.cfg, self.unavailable = client, keys, cfg, unavailable
        self._engines: tuple[float, list[EngineInfo]] = (0.0, [])
        # The read in flight, per event loop: callers share it (one read at a time).
        self._reads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[list[EngineInfo]]] = (
            weakref.WeakKeyDictionary()
        )

    async def tokenizer_files(self, model: str) -> dict[str, bytes] | None:
        """The files an engine of `model` published; None when none did, or when they
        are over MAX_TOKENIZER_BYTES (never read whole: the size is checked in Redis)."""
        try:
            got = await eval_script(
                self.client(), TOKENIZER_READ, [self.keys.tokenizer(model)], [MAX_TOKENIZER_BYTES]
            )
        except UNAVAILABLE as e:
            raise self.unavailable(e) from None
        if not int(got[0]):
            log.error(
                "the tokenizer published for %s is %s bytes, over %d: not read",
                model,
                got[1],
                MAX_TOKENIZER_BYTES,
            )
            return None
        flat = got[1:]
        names = [k.decode() if isinstance(k, bytes) else str(k) for k in flat[::2]]
        return {n: bytes(v) for n, v in zip(names, flat[1::2], strict=True) if n in TOKENIZER_FILES} or None

    async def engines(self) -> list[EngineInfo]:
        """The registered engines, from the cached copy while it is fresh. Past that, one
        read at a time: the callers that find one in flight wait for it instead of
        starting their own (on a slow Redis, every request admitted meanwhile would add a
        read of a GET and a PTTL per engine, slowing it further)."""
        at, cached = self._engines
        if time.monotonic() - at < ENGINES_CACHE_S:
            return cached
        loop = asyncio.get_running_loop()
        task = self._reads.get(loop)
        if task is None:
            task = self._reads[loop] = loop.create_task(self._read())
            task.add_done_callback(self._read_done)
        # shield: a caller that is cancelled must not cancel the read the others wait for
        return await asyncio.shield(task)

    def _read_done(self, task: asyncio.Task[list[EngineInfo]]) -> None:
        loop = task.get_loop()
        if self._reads.get(loop) is task:
            del self._reads[loop]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters may all have been cancelled

    async def _read(self) -> list[EngineInfo]:
        try:
            flat = await eval_script(self.client(), ENGINES, [self.keys.engines], [self.keys.engine("")])
        except UNAVAILABLE as e:
            raise self.unavailable(e) from None
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

    def routable(self, model: str, default_model: str) -> bool:
        """Whether routing `model`'s request can choose: false only while the cached copy
        is fresh and holds fewer than two engines of it (a routing read per submit would
        then be a command per request for nothing)."""
        at, cached = self._engines
        if time.monotonic() - at >= ENGINES_CACHE_S:
            return True
        return sum(1 for e in cached if (e.model or default_model) == model) >= 2

    def invalidate(self) -> None:
        self._engines = (0.0, [])
