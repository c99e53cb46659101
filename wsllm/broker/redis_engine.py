"""The engine side of the Redis broker: plain blocking redis-py, called from the
worker loop (no asyncio).

- `pull` reads the model's request stream as one consumer of the `engines` group,
  `COUNT` = the engine's free capacity. On its first call it drains its own pending
  entries (a restart under the same `--engine-id`), and every few seconds it takes
  entries whose engine stopped refreshing its lease (`redis_recovery.py` decides,
  this side applies). Every entry is decoded strictly (`wire.decode_request`); one
  that is not a valid request goes to the dead-letter stream with the reason, and so
  does a malformed entry of the abort stream.
- Each iteration's `pull` reads the model's abort stream and the queue's wake-up
  stream in one `XREAD` (for `aborts()`, and so that a take runs only when it may find
  something: `redis_queue.Taker`).
- `publish` sends one engine step in one pipelined round trip: one `XADD` per gateway
  (its results stream: that step's events of all its requests), a copy of a request's
  events to its own history stream every `history_flush_s` and when it ends, plus
  `XACK` + `XDEL` (+ expiry) for the requests that ended.
- `heartbeat` refreshes the registry and the lease on every entry this engine holds.
- A Redis outage pauses the engine: `publish` retries until Redis is back (or the
  broker closes); `pull` returns nothing meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.exceptions

from wsllm.broker.redis_dead import DeadLetters, abort_target
from wsllm.broker.redis_keys import GROUP, REFRESH, UNAVAILABLE, Keys
from wsllm.broker.redis_queue import EXPIRE, Taker, taken_key, wake_key
from wsllm.broker.redis_recovery import Decision, Entry, Recovery, reclaim_interval_s, results_of
from wsllm.broker.redis_registry import Registry
from wsllm.broker.replay import Plan, Replay
from wsllm.config_redis import RedisConfig
from wsllm.types import ERR_QUEUE_TIMEOUT, GenerateRequest, TokenEvent, WireError
from wsllm.wire import decode_request, encode

log = logging.getLogger(__name__)


_BLOCK_SLICE_S = 0.25  # a blocked pull re-checks close() this often
_RETRY_S = 0.5  # pause between tries while Redis is down
_EXPIRY_S = 0.25  # how often an engine sweeps the queue for entries past their deadline
_EXPIRY_SCAN = 4096  # waiting entries looked at per sweep
_EXPIRED_MSG = "no engine took this request in time"


@dataclass(slots=True)
class _Held:
    """A request this engine pulled and has not finished."""

    entry_id: str
    n: int
    request: GenerateRequest
    done: set[int]
    replay: Replay | None = None
    results: str = ""  # its gateway's results stream ("": none, every step goes to its history)
    start: str = "0-0"  # the results stream holds its events from this id on
    unflushed: list[TokenEvent] = field(default_factory=list)  # not yet in its history stream
    flushed_at: float = 0.0
    dropped: bool = False  # not ours any more (lost lease, handed back): publish nothing
    aborted: bool = False  # the worker was told to abort it


class EngineSide(Registry):
    def __init__(self, r: Any, keys: Keys, cfg: RedisConfig, model: str, consumer: str) -> None:
        self.r: Any = r  # redis-py's reply types are too loose to be useful here
        self.keys = keys
        self.cfg = cfg
        self.queue = keys.queue(model)
        self.model = model
        self.consumer = consumer
        self.closed = threading.Event()
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()  # _held is touched by pull/publish/heartbeat (one thread) and release
        self._started = False
        self._aborts_cursor: str | None = None
        self._aborts_key = keys.aborts(model)  # this model's engines' abort stream
        self._local_aborts: list[str] = []  # requests to stop that no gateway asked for
        self._next_reclaim = 0.0
        self._next_refresh = 0.0
        self._aborts_fresh = False  # pull read the abort stream since the last aborts()
        self._down = False  # Redis was unreachable at the last try
        self._refresh = r.register_script(REFRESH)
        self._expire = r.register_script(EXPIRE)
        self.taker = Taker(r, self.queue, GROUP, consumer, cfg.steal_after_s)
        self._next_expiry = 0.0
        self._maybe_waiting = True  # the last read filled its count: entries may wait
        self._results_ttl: dict[str, float] = {}  # results stream -> when its TTL was last set
        self._next_registry = 0.0
        # The failure event of an expired request, around its JSON-quoted id.
        before, after = encode([TokenEvent.failure("\0", ERR_QUEUE_TIMEOUT, _EXPIRED_MSG, 0)]).split(
            b'"\\u0000"'
        )
        self._expired_event = (before, after)
        self.dead = DeadLetters(r, keys, cfg, model, self.queue)
        self.recovery = Recovery(r, keys, cfg, model, consumer)

    # -- pull ------------------------------------------------------------------------

    def pull(self, max_n: int, timeout: float) -> list[GenerateRequest]:
        if self.closed.is_set():
            return []
        self._expire_waiting(max_n)  # also when this engine is full: that is when requests wait
        self.taker.tick()
        if max_n <= 0 and not self._started:
            return []
        try:
            if self._started and not (max_n > 0 and timeout > 0):
                self._poll()  # an idle engine reads both while it waits (_read_new)
            if max_n <= 0:
                return []
            out = self._start(max_n) if not self._started else []
            if len(out) < max_n and time.monotonic() >= self._next_reclaim:
                self._next_reclaim = time.monotonic() + reclaim_interval_s(self.cfg.lease_s)
                out += self._apply(self.recovery.reclaim(max_n - len(out), self.held_entry_ids()))
            if len(out) < max_n:
                out += self._read_new(max_n - len(out), 0.0 if out else timeout)
            if self._down:
                self._down = False
                log.warning("%s: redis is back", self.consumer)
            return out
        except UNAVAILABLE as e:
            if not self._down:  # once per outage, not once per try
                self._down = True
                log.warning("%s: redis unavailable (%s); retrying until it is back", self.consumer, e)
            self.closed.wait(min(max(timeout, 0.05), _RETRY_S))
            return []
        except redis.exceptions.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("the consumer group of %s is gone (redis restarted?); creating it", self.queue)
            self._ensure_group()
            return []

    def _expire_waiting(self, max_n: int) -> None:
        """End the waiting requests past their queue deadline (every engine sweeps a few
        times a second while requests may wait: it is full, or its last read took as many
        as it asked for; else every few seconds. The script makes the sweep and the
        engines' reads exclusive)."""
        now = time.monotonic()
        if now < self._next_expiry or (
            max_n > 0 and not self._maybe_waiting and now < self._next_expiry + 2.0
        ):
            return
        self._next_expiry = now + _EXPIRY_S
        retention_ms = int(self.cfg.stream_retention_s * 1000)
        args: list[str | int | bytes] = [
            _EXPIRY_SCAN,
            repr(time.time()),
            self.keys.out(self.model, ""),
            retention_ms,
        ]
        args += [*self._expired_event, self.keys.model_tag(self.model) + ":"]
        try:
            expired = self._expire(keys=[self.queue], args=args)
        except (*UNAVAILABLE, redis.exceptions.ResponseError) as e:  # pull() reports an outage
            log.debug("%s: queue-deadline sweep skipped (%s)", self.consumer, e)
            return
        if expired:
            log.info("%s: %d requests waited past their queue deadline", self.consumer, len(expired))

    def _start(self, max_n: int) -> list[GenerateRequest]:
        self._ensure_group()
        pipe = self.r.pipeline(transaction=False)
        pipe.xrevrange(self._aborts_key, count=1)
        pipe.xrevrange(wake_key(self.queue), count=1)
        last, wake = pipe.execute()
        self._aborts_cursor = last[0][0].decode() if last else "0-0"
        self.taker.woken(wake[0][0].decode() if wake else "0-0")
        # Our own pending entries first: a restart under the same consumer name.
        # More than it has room for stay pending; they are reclaimed after the lease.
        resp = self.r.xreadgroup(GROUP, self.consumer, {self.queue: "0"}, count=max_n)
        entries = resp[0][1] if resp else []
        self._started = True
        if entries:
            log.info("%s: picking up %d of its own pending requests", self.consumer, len(entries))
        return self._apply(self.recovery.decide([(i.decode(), f) for i, f in entries if f]))

    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.queue, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _read_new(self, count: int, timeout: float) -> list[GenerateRequest]:
        """New requests in the queue's turn (priority, tenants round robin, routed ones
        to their engine first: `redis_queue.py`)."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.taker.take(
                count, max(0.0, deadline - time.monotonic()), self.closed, _BLOCK_SLICE_S, self._poll
            )
            self._maybe_waiting = self.taker.more
            got = self._admit([(i.decode(), f) for i, f in entries])
            if got or time.monotonic() >= deadline or self.closed.is_set():
                return got

    def _admit(self, entries: list[Entry]) -> list[GenerateRequest]:
        """New entries; those handed back by another engine carry `h` and go through
        recovery (their result stream may hold tokens already)."""
        fresh, seen = [], []
        for entry_id, fields in entries:
            if fields.get(b"h"):
                seen.append((entry_id, fields))
                continue
            try:
                if b"r" not in fields or not set(fields) <= {b"r", b"i", b"d", b"s"}:
                    raise WireError(f"the entry must have the field r (and i, d, s); it has {sorted(fields)}")
                req = decode_request(fields[b"r"])
            except WireError as e:  # nobody can serve it: out of the queue, into the dead letters
                self.dead.request_entry(entry_id, fields, f"invalid request entry: {e}")
                continue
            if self.hold(entry_id, req, fields=fields):
                fresh.append(req)
        return fresh + (self._apply(self.recovery.decide(seen)) if seen else [])

    def _apply(self, decisions: list[Decision]) -> list[GenerateRequest]:
        """Carry out recovery's decisions; returns the requests to run here."""
        out = []
        for d in decisions:
            if d.request is not None and d.plan in (Plan.FRESH, Plan.REPLAY):
                if self.hold(d.entry_id, d.request, d.replay, d.fields):
                    out.append(d.request)
            elif d.plan is Plan.DEAD:
                self.dead.request_entry(d.entry_id, d.fields, d.reason, final=d.final)
            else:
                rid = d.request.request_id if d.request is not None else ""
                if d.final is not None:
                    self.final(rid, d.fields, d.final)
                self.ack([(d.entry_id, rid)])
        return out

    def hold(
        self,
        entry_id: str,
        req: GenerateRequest,
        replay: Replay | None = None,
        fields: dict[bytes, bytes] | None = None,
    ) -> bool:
        results, start = results_of(fields or {}, entry_id, self.keys.model_tag(self.model))
        with self._lock:
            if req.request_id in self._held:  # delivered twice (a hand-back raced): run it once
                log.warning("%s: %s is already running here", self.consumer, req.request_id)
                return False
            held = _Held(entry_id, req.params.n, req, set(), replay, results, start)
            held.flushed_at = time.monotonic()
            self._held[req.request_id] = held
        return True

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

    def held_entry_ids(self) -> set[str]:
        with self._lock:
            return {h.entry_id for h in self._held.values()}

    # -- aborts ----------------------------------------------------------------------

    def aborts(self) -> list[str]:
        """Aborts of requests this engine holds. Read after `pull` in the worker's
        iteration, so an abort that raced a pull still lands."""
        if self._aborts_fresh:  # read by this iteration's pull, just before this call
            self._aborts_fresh = False
        elif self._started and not self.closed.is_set():
            with contextlib.suppress(*UNAVAILABLE):
                self._take_aborts(self.r.xread({self._aborts_key: self._aborts_cursor or "0-0"}, count=10000))
        out, self._local_aborts = self._local_aborts, []
        return list(dict.fromkeys(out))

    def _poll(self, block_ms: int | None = None) -> None:
        """One XREAD of the abort stream and the queue's wake-up stream (waiting up to
        `block_ms` for either): the aborts for `aborts()`, the wake-up for the taker (a
        take runs only when it may find something)."""
        try:
            resp = self.r.xread(
                {self._aborts_key: self._aborts_cursor or "0-0", self.taker.wake: self.taker.cursor or "0-0"},
                count=10000,
                block=block_ms,
            )
        except UNAVAILABLE:
            if block_ms is not None:  # the wait of a pull: it reports the outage and backs off
                raise
            return
        aborts = []
        for key, entries in resp or []:
            if (key.decode() if isinstance(key, bytes) else key) == self.taker.wake:
                if entries:
                    self.taker.woken(entries[-1][0].decode())
            else:
                aborts.append((key, entries))
        self._take_aborts(aborts)
        self._aborts_fresh = True

    def _take_aborts(self, resp: Any) -> None:
        if not resp or not resp[0][1]:
            return
        entries = resp[0][1]
        self._aborts_cursor = entries[-1][0].decode()
        bad = []
        with self._lock:
            for entry_id, f in entries:
                rid = abort_target(f)
                if rid is None:
                    bad.append((entry_id.decode(), f))
                    continue
                held = self._held.get(rid)
                if held is not None and not held.aborted:
                    held.aborted = True
                    self._local_aborts.append(rid)
        for entry_id, f in bad:
            self.dead.abort_entry(entry_id, f)

    # -- publish ---------------------------------------------------------------------

    def publish(self, events: list[TokenEvent]) -> None:
        by_request: dict[str, list[TokenEvent]] = {}
        for ev in events:
            by_request.setdefault(ev.request_id, []).append(ev)
        live: dict[str, list[TokenEvent]] = {}  # results stream -> this step's events for it
        history: list[tuple[str, bytes]] = []  # (request id, its events), in XADD order
        ended: list[tuple[str, str]] = []
        now = time.monotonic()
        with self._lock:
            for rid, evs in by_request.items():
                held = self._held.get(rid)
                if held is None:  # not running here: its history gets it, nothing else knows where
                    history.append((rid, encode(evs)))
                    continue
                evs = self._filter(held, evs)
                done = self._ended(held, evs)
                if done:
                    del self._held[rid]
                    if not held.dropped:
                        ended.append((held.entry_id, rid))
                if held.dropped:
                    continue
                if evs and held.results:
                    live.setdefault(held.results, []).extend(evs)
                held.unflushed.extend(evs)
                # The history gets a copy now and then; an ended request's last events stay
                # in the results stream for the retention (RedisConfig.results_tail_s).
                if held.unflushed and (not held.results or now - held.flushed_at >= self.cfg.history_flush_s):
                    history.append((rid, encode(held.unflushed)))
                    held.unflushed, held.flushed_at = [], now
        if not live and not history and not ended:
            return
        self._write(live, history, ended)

    def _write(
        self,
        live: dict[str, list[TokenEvent]],
        history: list[tuple[str, bytes]],
        ended: list[tuple[str, str]],
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
                self._drop(rid)

    def _filter(self, held: _Held, evs: list[TokenEvent]) -> list[TokenEvent]:
        if held.dropped or held.replay is None:
            return evs
        out = held.replay.filter(evs)
        if held.replay.failed:
            self._local_aborts.append(held.request.request_id)
        return out

    @staticmethod
    def _ended(held: _Held, evs: list[TokenEvent]) -> bool:
        for ev in evs:
            if ev.ends_request:
                return True
            if ev.finish_reason is not None:
                held.done.add(ev.index)
        return len(held.done) >= held.n or (held.replay is not None and held.replay.failed)

    def _drop(self, rid: str) -> None:
        with self._lock:
            held = self._held.get(rid)
            if held is not None and not held.dropped:
                held.dropped = True
                self._local_aborts.append(rid)

    def _add_acks(self, pipe: Any, ended: list[tuple[str, str]]) -> None:
        retention = int(self.cfg.stream_retention_s * 1000)
        if ended:  # one XACK and one XDEL for the step, whatever ended in it
            ids = [entry_id for entry_id, _ in ended]
            pipe.xack(self.queue, GROUP, *ids)
            pipe.xdel(self.queue, *ids)
        for _, rid in ended:
            if rid:
                pipe.pexpire(self.keys.out(self.model, rid), retention)
        rids = [rid for _, rid in ended if rid]
        if rids:  # one command for the step: the take's record of where they were
            pipe.hdel(taken_key(self.queue), *rids)

    def ack(self, ended: list[tuple[str, str]]) -> None:
        self._execute(lambda pipe: self._add_acks(pipe, ended))

    def _execute(self, build: Callable[[Any], None], transaction: bool = False) -> list[Any] | None:
        """Build and run a pipeline, again while Redis is down (a pipeline is emptied
        by a failed run); None when the broker closed. A retry may repeat an XADD that
        went through: gateways drop duplicates by seq."""
        while True:
            pipe = self.r.pipeline(transaction=transaction)
            build(pipe)
            try:
                return list(pipe.execute(raise_on_error=False))
            except UNAVAILABLE as e:
                if self.closed.is_set():
                    log.warning("redis unavailable and the broker closed; dropping a batch")
                    return None
                if not self._down:
                    self._down = True
                    log.warning("%s: redis unavailable (%s); the step waits for it", self.consumer, e)
                self.closed.wait(_RETRY_S)
