"""The engine side's registry and lease calls (`redis_engine.EngineSide` inherits them):
the heartbeat (the engine's registry key, and a few times per lease the refresh of the
entries it holds), the published tokenizer, deregistering, and handing requests back to
the queue on shutdown."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import orjson
import redis.exceptions

from wsllm.broker.redis_keys import GROUP, UNAVAILABLE, Keys
from wsllm.broker.redis_queue import counters_key, wake_key
from wsllm.config_redis import RedisConfig
from wsllm.types import EngineInfo
from wsllm.wire import encode

log = logging.getLogger(__name__)

# A model's published tokenizer outlives its last engine by this much (milliseconds).
_TOKENIZER_TTL_MS = 24 * 3600 * 1000


class Registry:
    r: Any
    keys: Keys
    cfg: RedisConfig
    model: str
    queue: str
    consumer: str
    _lock: threading.Lock
    _held: dict[str, Any]  # redis_engine._Held (not imported: redis_engine imports this module)
    _started: bool
    _next_refresh: float
    _next_registry: float
    _refresh: Any

    def _drop(self, rid: str) -> None:
        raise NotImplementedError

    # -- registry and leases -----------------------------------------------------------

    def heartbeat(self, info: EngineInfo) -> None:
        d = info.to_dict() | {"last_seen": time.time()}
        ttl_ms = int(self.cfg.engine_ttl_s * 1000)
        with self._lock:
            owned = {h.entry_id: rid for rid, h in self._held.items() if not h.dropped}
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.keys.engine(info.engine_id), orjson.dumps(d), px=ttl_ms)
            if time.monotonic() >= self._next_registry:  # the set and the tokenizer's TTL need less
                self._next_registry = time.monotonic() + self.cfg.engine_ttl_s / 4
                pipe.sadd(self.keys.engines, info.engine_id)
                pipe.pexpire(self.keys.tokenizer(self.model), _TOKENIZER_TTL_MS)
            pipe.execute()
            # Refreshing the leases a few times per lease is enough (and cheap).
            if owned and self._started and time.monotonic() >= self._next_refresh:
                self._next_refresh = time.monotonic() + self.cfg.lease_s / 4
                args = [GROUP, self.consumer, 2 * len(owned) + 1000, *owned]
                lost = self._refresh(keys=[self.queue], args=args)
                for entry_id in lost or []:
                    rid = owned[entry_id.decode() if isinstance(entry_id, bytes) else entry_id]
                    log.warning("%s: lost its lease on %s; stopping it here", self.consumer, rid)
                    self._drop(rid)
        except UNAVAILABLE as e:
            log.debug("redis unavailable for the heartbeat (%s)", e)
        except redis.exceptions.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            for rid in owned.values():  # the group (and our entries) are gone: Redis restarted
                self._drop(rid)

    def publish_tokenizer(self, files: dict[str, bytes]) -> None:
        """Store this model's tokenizer files for the gateways (kept while any engine of
        the model heartbeats, then for a day)."""
        key = self.keys.tokenizer(self.model)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        if files:
            pipe.hset(key, mapping=files)
            pipe.pexpire(key, _TOKENIZER_TTL_MS)
        pipe.execute()

    def deregister(self, engine_id: str) -> None:
        self._next_registry = 0.0  # a heartbeat after this one registers it again at once
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.delete(self.keys.engine(engine_id))
            pipe.srem(self.keys.engines, engine_id)
            pipe.execute()
            if self._started and not self._held:
                pending = self.r.xpending_range(self.queue, GROUP, "-", "+", 1, consumername=self.consumer)
                if not pending:
                    self.r.xgroup_delconsumer(self.queue, GROUP, self.consumer)
        except UNAVAILABLE as e:
            log.warning("redis unavailable while deregistering (%s)", e)
        except redis.exceptions.ResponseError:
            pass

    def release(self, request_ids: list[str]) -> list[str]:
        """Re-queue held requests (marked `h`: their result streams are checked when
        they are pulled again; counted as waiting until a take delivers them) and ack
        the old entries, atomically per request; then wake the model's engines."""
        left = []
        for rid in request_ids:
            with self._lock:
                held = self._held.get(rid)
            if held is None or held.dropped:
                left.append(rid)
                continue
            fields = {"r": encode(held.request), "h": "1", "s": held.results, "st": held.start}
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
