"""The engine side of the Redis broker (`RedisEngine`, the `EngineBroker` contract):
plain blocking redis-py, called from the worker loop (no asyncio).

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
- `publish` sends one engine step in one pipelined round trip (`redis_publish.py`).
- `heartbeat` refreshes the registry and the lease on every entry this engine holds
  (`redis_registry.py`); what it holds is `redis_held.py`'s table, shared by the three.
- A Redis outage pauses the engine: `publish` retries until Redis is back (or the
  broker closes); `pull` returns nothing meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Any

import redis
import redis.exceptions

from wsllm.broker import prefix_routing
from wsllm.broker.base import EngineBroker, Rank
from wsllm.broker.redis_adapters import command_of, send_reply
from wsllm.broker.redis_conn import sync_client
from wsllm.broker.redis_dead import DeadLetters, abort_target
from wsllm.broker.redis_held import HeldRequests
from wsllm.broker.redis_keys import GROUP, UNAVAILABLE, Keys
from wsllm.broker.redis_publish import Publisher
from wsllm.broker.redis_queue import Taker, wake_key
from wsllm.broker.redis_recovery import Decision, Entry, Recovery, reclaim_interval_s, results_of
from wsllm.broker.redis_registry import Registry
from wsllm.broker.redis_scripts import EXPIRE
from wsllm.broker.replay import Plan, Replay
from wsllm.config_redis import RedisConfig
from wsllm.types import (
    ERR_QUEUE_TIMEOUT,
    AdapterCommand,
    AdapterReply,
    EngineInfo,
    GenerateRequest,
    TokenEvent,
    WireError,
)
from wsllm.wire import decode_request, encode

log = logging.getLogger(__name__)


_BLOCK_SLICE_S = 0.25  # a blocked pull re-checks close() this often
_RETRY_S = 0.5  # pause between tries while Redis is down
_EXPIRY_S = 0.25  # how often an engine sweeps the queue for entries past their deadline
_EXPIRY_SCAN = 4096  # waiting entries looked at per sweep
_EXPIRED_MSG = "no engine took this request in time"


class RedisEngine(EngineBroker):
    """One engine's side of the Redis broker, for `model`; `engine_id` names its consumer
    (a stable one picks up its own pending work after a restart)."""

    def __init__(
        self, url: str, *, model: str, cfg: RedisConfig | None = None, engine_id: str | None = None
    ) -> None:
        self.cfg = cfg = cfg or RedisConfig()
        self.keys = keys = Keys(cfg.redis_prefix)
        # Blocking reads wait at most _BLOCK_SLICE_S at a time.
        self.r: Any = sync_client(url, cfg, wait_s=_BLOCK_SLICE_S)  # redis-py's replies are loose
        self.model = model
        self.queue = keys.queue(model)
        self.consumer = consumer = engine_id or cfg.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.closed = threading.Event()
        self.held = HeldRequests()
        self._aborts_cursor: str | None = None
        self._aborts_key = keys.aborts(model)  # this model's engines' abort stream
        self._next_reclaim = 0.0
        self._aborts_fresh = False  # pull read the abort stream since the last aborts()
        self._commands: list[AdapterCommand] = []  # adapter commands read with the aborts
        self._down = False  # Redis was unreachable at the last try
        self._expire = self.r.register_script(EXPIRE)
        self.taker = Taker(self.r, self.queue, GROUP, consumer, cfg.steal_after_s)
        self._next_expiry = 0.0
        self._maybe_waiting = True  # the last read filled its count: entries may wait
        # The failure event of an expired request, around its JSON-quoted id.
        before, after = encode([TokenEvent.failure("\0", ERR_QUEUE_TIMEOUT, _EXPIRED_MSG, 0)]).split(
            b'"\\u0000"'
        )
        self._expired_event = (before, after)
        self.dead = DeadLetters(self.r, keys, cfg, model, self.queue)
        self.recovery = Recovery(self.r, keys, cfg, model, consumer)
        self.registration = Registry(self.r, keys, cfg, model, consumer, self.held)
        self.publisher = Publisher(self.r, keys, cfg, model, consumer, self.held, self.closed)
        self._prefix = _PrefixSummary()

    # -- pull ------------------------------------------------------------------------

    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        # a stream is read in order: `rank` (the memory broker's) is not used
        if self.closed.is_set():
            return []
        self._expire_waiting(max_n)  # also when this engine is full: that is when requests wait
        self.taker.tick()
        if max_n <= 0 and not self.held.started:
            return []
        try:
            if self.held.started and not (max_n > 0 and timeout > 0):
                self._poll()  # an idle engine reads both while it waits (_read_new)
            if max_n <= 0:
                return []
            out = self._start(max_n) if not self.held.started else []
            if len(out) < max_n and time.monotonic() >= self._next_reclaim:
                self._next_reclaim = time.monotonic() + reclaim_interval_s(self.cfg.lease_s)
                out += self._apply(self.recovery.reclaim(max_n - len(out), self.held.entry_ids()))
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
        self.held.started = True
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
                if self.hold(d.entry_id, d.request, d.replay, d.fields, d.marks):
                    out.append(d.request)
            elif d.plan is Plan.DEAD:
                self.dead.request_entry(d.entry_id, d.fields, d.reason, final=d.final)
            else:
                rid = d.request.request_id if d.request is not None else ""
                if d.final is not None:
                    self.publisher.final(rid, d.fields, d.final)
                self.publisher.ack([(d.entry_id, rid)])
        return out

    def hold(
        self,
        entry_id: str,
        req: GenerateRequest,
        replay: Replay | None = None,
        fields: dict[bytes, bytes] | None = None,
        marks: tuple[int, int] = (1, 0),
    ) -> bool:
        results, start = results_of(fields or {}, entry_id, self.keys.model_tag(self.model))
        if not self.held.hold(entry_id, req, replay, results, start, marks):  # delivered twice: run it once
            log.warning("%s: %s is already running here", self.consumer, req.request_id)
            return False
        return True

    # -- aborts ----------------------------------------------------------------------

    def aborts(self) -> list[str]:
        """Aborts of requests this engine holds. Read after `pull` in the worker's
        iteration, so an abort that raced a pull still lands."""
        if self._aborts_fresh:  # read by this iteration's pull, just before this call
            self._aborts_fresh = False
        elif self.held.started and not self.closed.is_set():
            with contextlib.suppress(*UNAVAILABLE):
                self._take_aborts(self.r.xread({self._aborts_key: self._aborts_cursor or "0-0"}, count=10000))
        return self.held.take_aborts()

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
        with self.held.lock:
            for entry_id, f in entries:
                if b"c" in f:  # an adapter command (redis_adapters.py), for commands()
                    cmd = command_of(f)
                    self._commands += [cmd] if cmd is not None else []
                    bad += [] if cmd is not None else [(entry_id.decode(), f)]
                    continue
                rid = abort_target(f)
                if rid is None:
                    bad.append((entry_id.decode(), f))
                    continue
                held = self.held.by_id.get(rid)
                if held is not None and not held.aborted:
                    held.aborted = True
                    self.held.abort(rid)
        for entry_id, f in bad:
            self.dead.abort_entry(entry_id, f)

    # -- publish, registry, leases ----------------------------------------------------

    def publish(self, events: list[TokenEvent]) -> None:
        if events and not self.closed.is_set():
            self.publisher.publish(events)

    def heartbeat(self, info: EngineInfo) -> None:
        self.taker.adapters = list(info.adapters)  # it takes the requests of the adapters it holds
        self.registration.heartbeat(info)

    def commands(self) -> list[AdapterCommand]:
        out, self._commands = self._commands, []
        return out

    def reply(self, reply: AdapterReply) -> None:
        with contextlib.suppress(*UNAVAILABLE):  # the gateway then goes without this engine's answer
            send_reply(self.r, self.keys, self.model, reply)

    def publish_tokenizer(self, model: str, files: dict[str, bytes]) -> None:
        if model != self.model:
            raise ValueError(f"this engine side serves {self.model!r}, not {model!r}")
        self.registration.publish_tokenizer(files)

    def deregister(self, engine_id: str) -> None:
        self.registration.deregister(engine_id)

    def release(self, request_ids: list[str], stalled: bool = False) -> list[str]:
        return self.registration.release(request_ids, stalled)

    def dead_letter(self, item: object, reason: str) -> None:
        self.dead.item(item, reason)

    def routes_by_prefix(self) -> bool:
        return self.cfg.routing == "prefix"

    def publish_prefix(self, block_size: int, keys: list[bytes]) -> None:
        """Which prefix blocks this engine caches, for prefix-aware routing (the worker
        calls it where `routes_by_prefix`)."""
        if self.cfg.routing == "prefix" and not self.closed.is_set():
            self._prefix.send(self.r, self.queue, self.consumer, self.cfg.engine_ttl_s, block_size, keys)

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.r.close()


class _PrefixSummary:
    """What this engine last told of its cached prefix blocks: the same summary is sent
    again only when its TTL draws near."""

    def __init__(self) -> None:
        self._versions_ttl_at = 0.0  # when the prefix versions hash needs its TTL again
        self._sent: tuple[int, int, float] = (0, 0, 0.0)  # (block size, keys hash, when)

    def send(
        self, r: Any, queue: str, consumer: str, ttl_s: float, block_size: int, keys: list[bytes]
    ) -> None:
        now = time.monotonic()
        sent = (block_size, hash(tuple(keys)), now)
        if sent[:2] == self._sent[:2] and now - self._sent[2] < ttl_s / 4:
            return  # the same summary, and its TTL is far off: nothing to tell
        try:
            refresh = now >= self._versions_ttl_at
            prefix_routing.publish(r, queue, consumer, block_size, keys, int(ttl_s * 1000), refresh)
            self._sent = sent
            if refresh:
                self._versions_ttl_at = now + ttl_s / 4
        except UNAVAILABLE as e:
            log.debug("redis unavailable for the prefix summary (%s)", e)
