"""An engine step's events into Redis (the engine side's `publish`): one pipelined
round trip per step: one `XADD` per gateway (its results stream: that step's events
of all its requests), a copy of a request's events to its own history stream every
`history_flush_s` and when it ends, plus `XACK` + `XDEL` (+ expiry, and their
tenants' retention: redis_retention.py) for the requests that ended. While Redis is down it retries until Redis is back or the broker closes
(gateways drop a repeated event by its `seq`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from wsllm.broker.redis_held import Held, HeldRequests
from wsllm.broker.redis_keys import GROUP, UNAVAILABLE, Keys
from wsllm.broker.redis_queue import taken_key
from wsllm.broker.redis_recovery import results_of
from wsllm.broker.redis_retention import retain
from wsllm.config_redis import RedisConfig
from wsllm.types import TokenEvent
from wsllm.wire import encode

log = logging.getLogger(__name__)

_RETRY_S = 0.5  # pause between tries while Redis is down


class Publisher:
    def __init__(
        self,
        r: Any,
        keys: Keys,
        cfg: RedisConfig,
        model: str,
        consumer: str,
        held: HeldRequests,
        closed: threading.Event,
    ) -> None:
        self.r: Any = r  # redis-py's reply types are too loose to be useful here
        self.keys, self.cfg, self.model, self.consumer = keys, cfg, model, consumer
        self.queue = keys.queue(model)
        self.held = held
        self.closed = closed
        self._results_ttl: dict[str, float] = {}  # results stream -> when its TTL was last set
        self._down = False  # Redis was unreachable at the last try

    def publish(self, events: list[TokenEvent]) -> None:
        by_request: dict[str, list[TokenEvent]] = {}
        for ev in events:
            by_request.setdefault(ev.request_id, []).append(ev)
        live: dict[str, list[TokenEvent]] = {}  # results stream -> this step's events for it
        history: list[tuple[str, bytes]] = []  # (request id, its events), in XADD order
        ended: list[tuple[str, str]] = []
        kept: dict[str, list[tuple[str, int]]] = {}  # tenant -> its ended requests' history bytes
        now = time.monotonic()
        with self.held.lock:
            for rid, evs in by_request.items():
                held = self.held.by_id.get(rid)
                if held is None:  # not running here: its history gets it, nothing else knows where
                    history.append((rid, encode(evs)))
                    continue
                evs = self._filter(held, evs)
                done = self._ended(held, evs)
                if done:
                    del self.held.by_id[rid]
                    if not held.dropped:
                        ended.append((held.entry_id, rid))
                if held.dropped:
                    continue
                if evs and held.results:
                    live.setdefault(held.results, []).extend(evs)
                held.unflushed.extend(evs)
                # The history gets a copy now and then, and the last events when the request
                # ends: the results stream keeps a short tail only (RedisConfig.results_tail_s).
                flush = done or not held.results or now - held.flushed_at >= self.cfg.history_flush_s
                if held.unflushed and flush:
                    data = encode(held.unflushed)
                    history.append((rid, data))
                    held.history_bytes += len(data)
                    held.unflushed, held.flushed_at = [], now
                if done:
                    kept.setdefault(held.request.tenant, []).append((rid, held.history_bytes))
        if live or history or ended:
            self._write(live, history, ended, kept)

    def _write(
        self,
        live: dict[str, list[TokenEvent]],
        history: list[tuple[str, bytes]],
        ended: list[tuple[str, str]],
        kept: dict[str, list[tuple[str, int]]],
    ) -> None:
        tail_s = self.cfg.results_tail_s
        min_id = f"{max(0, int((time.time() - tail_s) * 1000))}-0"
        now = time.monotonic()
        expire = [k for k in live if now - self._results_ttl.get(k, -tail_s) >= tail_s / 4]
        live_data = [(key, encode(evs)) for key, evs in live.items()]

        def build(pipe: Any) -> None:
            for rid, data in history:
                pipe.xadd(self.keys.out(self.model, rid), {"e": data}, nomkstream=True)
            for key, data in live_data:
                pipe.xadd(key, {"e": data}, minid=min_id, approximate=True)
            for key in expire:  # the stream of a gateway gone for good goes away
                pipe.pexpire(key, self.cfg.results_ttl_ms)
            self._add_acks(pipe, ended)
            retain(pipe, self.keys, self.cfg, self.model, kept)  # after their expiry is set

        # One pipeline, no MULTI: each gateway's read wakes once anyway (one entry per step).
        results = self._execute(build)
        if results is None:
            return
        for key in expire:
            self._results_ttl[key] = now
        if len(self._results_ttl) > 4 * max(1, len(live)) + 64:  # forget streams not written lately
            self._results_ttl = {k: t for k, t in self._results_ttl.items() if now - t < tail_s}
        for (rid, _), res in zip(history, results, strict=False):
            if res is None:  # its history stream is gone (expired, or Redis lost it): stop it
                self.held.drop(rid)

    def _filter(self, held: Held, evs: list[TokenEvent]) -> list[TokenEvent]:
        if held.dropped or held.replay is None:
            return evs
        out = held.replay.filter(evs)
        if held.replay.failed:
            self.held.abort(held.request.request_id)
        return out

    @staticmethod
    def _ended(held: Held, evs: list[TokenEvent]) -> bool:
        for ev in evs:
            if ev.ends_request:
                return True
            if ev.finish_reason is not None:
                held.done.add(ev.index)
        return len(held.done) >= held.n or (held.replay is not None and held.replay.failed)

    def final(self, rid: str, fields: dict[bytes, bytes], ev: TokenEvent) -> None:
        """A request's last event, from recovery: to its history and its gateway."""
        results, _ = results_of(fields, "", self.keys.model_tag(self.model))
        data = encode([ev])
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(self.keys.out(self.model, rid), {"e": data}, nomkstream=True)
        if results:
            pipe.xadd(results, {"e": data})
            pipe.pexpire(results, self.cfg.results_ttl_ms)
        pipe.execute()

    def _add_acks(self, pipe: Any, ended: list[tuple[str, str]]) -> None:
        retention = int(self.cfg.stream_retention_s * 1000)
        if ended:  # one XACK and one XDEL for the step, whatever ended in it
            ids = [entry_id for entry_id, _ in ended]
            pipe.xack(self.queue, GROUP, *ids)
            pipe.xdel(self.queue, *ids)
        for _, rid in ended:
            if rid:  # its keys shrink to the retention: its history, and its resume count if any
                pipe.pexpire(self.keys.out(self.model, rid), retention)
                pipe.pexpire(self.keys.attached(self.model, rid), retention)
        rids = [rid for _, rid in ended if rid]
        if rids:  # one command for the step: the take's record of where they were
            pipe.hdel(taken_key(self.queue), *rids)

    def ack(self, ended: list[tuple[str, str]]) -> None:
        """Acknowledge entries (entry id, request id) that ended without events from here."""
        self._execute(lambda pipe: self._add_acks(pipe, ended))

    def _execute(self, build: Callable[[Any], None]) -> list[Any] | None:
        """Build and run a pipeline, again while Redis is down (a pipeline is emptied
        by a failed run); None when the broker closed. A retry may repeat an XADD that
        went through: gateways drop duplicates by seq."""
        while True:
            pipe = self.r.pipeline(transaction=False)
            build(pipe)
            try:
                out = list(pipe.execute(raise_on_error=False))
            except UNAVAILABLE as e:
                if self.closed.is_set():
                    log.warning("redis unavailable and the broker closed; dropping a batch")
                    return None
                if not self._down:
                    self._down = True
                    log.warning("%s: redis unavailable (%s); the step waits for it", self.consumer, e)
                self.closed.wait(_RETRY_S)
                continue
            self._down = False
            return out
