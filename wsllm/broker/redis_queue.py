"""The Redis queue of one model: priority levels, fair share by tenant, per-tenant
depth, and the target engine of a routed request (the rules are in `fair_queue.py`).
Every gateway and engine applies them atomically, in Lua: the scripts are
`lua/queue_*.lua` (submit, take, the deadline sweep, positions, abort; `queue_lib.lua`
their shared counters); this module is the Python around them (the engine's `Taker`,
the submit's arguments) and says the layout they share.

A waiting request is one member of a sorted set, and its place in the queue is the
member's own bytes: every member has the score 0, so the set orders them by a fixed
header (inverted priority, then the tenant's virtual time, then the submit order),
and the request itself follows the header. Submitting gives a request its virtual
time at once: the next of its tenant's at that priority, or the level's clock when
the tenant has none waiting there (it joins now: next in turn, no banked turns), so
taking in member order is round robin by tenant inside a level, highest level first.
An engine's take pops the best members for all its free slots in one script and
moves them, in that script, into the model's request stream (`Keys.queue`), which
delivers them to the engine as a consumer of the `engines` group: everything after
the take is unchanged (leases, XAUTOCLAIM recovery, hand-back, dead letters).
Counters replace scans: the submit reads and writes one hash, so its cost does not
grow with the queue. Keys, all suffixes of the request stream's key (so they share
its Redis Cluster hash slot):

    {queue}:z               sorted set of the waiting requests any engine may take
    {queue}:z:{engine}      those routed to `engine` (prefix routing): it takes them
                            first, any engine once they waited `steal_after_s` and it
                            is busy (see lua/queue_take.lua)
    {queue}:z:@{adapter}    those for a LoRA adapter: only the engines that hold it take
                            them (their heartbeats say which; redis_adapters.py)
    {queue}:ze              set of the engines with routed requests waiting
    {queue}:n               hash of counters: n (waiting), h (hand-backs not yet
                            delivered), rt (routed), s (submit order), and per tenant
                            t:{tenant}, per level l:{prio} and its clock c:{prio}, per
                            (level, tenant) k:{prio}:{tenant} and its last virtual time
                            v:{prio}:{tenant}, per engine e:{engine}, and w (a wake-up
                            was sent and no take has run since); gone once nothing
                            waits
    {queue}:nt              one-entry stream that wakes engines on a submit (idle ones
                            block on it; busy ones read it with the abort stream); a
                            submit writes it only when no wake-up is pending (`w`)
    {queue}:seen            hash: per engine, its last take, its usual interval between
                            takes and whether its last take filled its room
    {queue}:rc              recovery's turn: the engine that scans the request stream's
                            pending list in this interval (`redis_recovery.py`); expires
                            by itself
    {queue}:tk              hash: request id -> its entry in the request stream, from the
                            take until the engine acks it (an abort deletes the entry
                            there once it left the waiting set: lua/queue_abort.lua)

A member is `HEADER` (54 bytes: 7 digits of 1,000,000 - priority, 15 of virtual time,
12 of submit order, 20 of queue deadline) followed by the MessagePack of (request id,
results stream, tenant, routed engine or '', submit time in ms, request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_scripts import POSITIONS, TAKE

log = logging.getLogger(__name__)

#: entries of a busy peer's routed set an engine looks through for ones it may steal
SCAN = 16
#: a take is due at least this often while an engine has room, wake-up or not
_TAKE_EVERY_S = 5.0
#: waiting requests whose positions a gateway reads every `queue_poll_s / 2`; more stretch the interval
POSITIONS_PER_POLL = 256


def taken_key(queue: str) -> str:
    """The hash of taken requests' entries in the request stream (see the module doc)."""
    return f"{queue}:tk"


def counters_key(queue: str) -> str:
    """The hash of the queue's counters (see the module doc)."""
    return f"{queue}:n"


def wake_key(queue: str) -> str:
    """The stream that wakes the model's engines on a submit or a hand-back."""
    return f"{queue}:nt"


def waiting_key(queue: str, engine: str = "") -> str:
    """The sorted set where requests routed to `engine` wait ('': any engine's)."""
    return f"{queue}:z:{engine}" if engine else f"{queue}:z"


class Taker:
    """An engine's takes from its model's queue (blocking redis-py, the worker's
    thread): `take(count, timeout)` returns the delivered entries, waiting up to
    `timeout` for a submit when none is there.

    A take is one script (about ten commands inside), so the engine runs it only when
    it may find something: the wake-up stream moved since the last take (a submit or
    a hand-back: the engine reads it each iteration together with the abort stream,
    one command, and hands what it read to `woken`), the last take filled its count, a
    peer's routed requests may have become stealable, or `_TAKE_EVERY_S` passed."""

    def __init__(self, r: Any, queue: str, group: str, consumer: str, steal_after_s: float) -> None:
        self.r = r
        self.queue = queue
        self.wake = wake_key(queue)
        self.group = group
        self.consumer = consumer
        self.steal_ms = int(steal_after_s * 1000)
        self._take = r.register_script(TAKE)
        self.cursor: str | None = None  # the newest wake-up entry seen (None: not read yet)
        self._cursor_at_take: str | None = ""  # the cursor when the last take was sent
        self._due = 0.0  # a take is due by this time (monotonic) whatever the wake-up says
        self._more = True  # the last take filled its count: more may wait
        self._tick = 0.0  # the engine's last iteration (monotonic) and its usual interval (ms)
        self._period = 0.0
        self._told: tuple[int, float] = (-1, 0.0)  # the interval peers know of, and since when
        self.takes = 0
        self.adapters: list[str] = []  # the LoRA adapters the engine holds: it takes their requests

    def tick(self) -> None:
        """One iteration of the engine (each pull): its usual interval between them is
        what peers wait, twice over, before they take a request routed to it."""
        now = time.monotonic()
        if self._tick:
            self._period = 0.8 * self._period + 0.2 * min((now - self._tick) * 1000, 1000.0)
        self._tick = now

    def woken(self, entry_id: str) -> None:
        """The newest wake-up entry, read with the abort stream."""
        self.cursor = entry_id

    @property
    def more(self) -> bool:
        """The last take filled its count: more requests may wait."""
        return self._more

    def due(self) -> bool:
        return self._more or self.cursor != self._cursor_at_take or time.monotonic() >= self._due

    def take(
        self,
        count: int,
        timeout: float,
        closed: threading.Event,
        slice_s: float,
        wait: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """Raw XREADGROUP entries: [(entry id, fields), ...]. Waits on the wake-up
        stream in slices of `slice_s` (so that `closed` is seen); `wait(ms)`, when
        given, is the blocking read instead (the engine's: it reads the abort stream too,
        and hands the wake-up to `woken`)."""
        deadline = time.monotonic() + timeout
        if self.cursor is None:
            last = self.r.xrevrange(self.wake, count=1)
            self.cursor = last[0][0].decode() if last else "0-0"
        while True:
            entries: list[Any] = []
            if self.due():
                entries = self._once(count)
            left = deadline - time.monotonic()
            if entries or left <= 0.001 or closed.is_set():
                return entries
            block = min(left, slice_s, max(self._due - time.monotonic(), 0.001))
            if wait is not None:
                wait(max(int(block * 1000), 1))
                continue
            resp = self.r.xread({self.wake: self.cursor}, count=1, block=max(int(block * 1000), 1))
            if resp:
                self.cursor = resp[0][1][-1][0].decode()

    def _once(self, count: int) -> list[Any]:
        now = time.monotonic()
        cursor, periodic = self.cursor, now >= self._due
        # Peers need this engine's interval when it moved by a quarter, or a while since.
        period = round(self._period)
        told, told_at = self._told
        tell = abs(period - told) > max(told / 4, 5) or now - told_at >= _TAKE_EVERY_S
        if tell:
            self._told = (period, now)
        args = [self.group, self.consumer, count, self.consumer, self.steal_ms, SCAN, period if tell else ""]
        # Read the request stream even if nothing moves now after a take that filled its
        # count (what it moved may wait there still), and now and then.
        args += ["1" if periodic or self._more else "", "1" if self._more else "0", *self.adapters]
        retry, resp = self._take(keys=[self.queue], args=args)
        self.takes += 1
        self._cursor_at_take = cursor
        # A script's reply is raw: each entry's fields come as a flat list.
        entries = [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in (resp[0][1] if resp else [])]
        self._more = len(entries) >= count
        wait_s = _TAKE_EVERY_S if int(retry) < 0 else max(int(retry), 5) / 1000
        self._due = time.monotonic() + wait_s
        return entries


def submit_args(
    depth: int,
    cap: int,
    request: bytes,
    meta: bytes,
    ttl_ms: int,
    request_id: str,
    deadline: float,
    priority: int,
    tenant: str,
    target: str,
    results: str,
) -> list[Any]:
    """ARGV of SUBMIT (lua/queue_submit.lua), in order."""
    return [depth, cap, request, meta, ttl_ms, request_id, repr(deadline), priority, tenant, target, results]


class Positions:
    """A gateway's view of where its waiting requests stand (WebSocket `queued`): the
    set and header of each, from its submit until its first event, and their places,
    read for all of them at once (one POSITIONS script per model) at most every
    `poll_s / 2`; past `POSITIONS_PER_POLL` waiting requests, less often, so that a long
    queue does not make Redis slower to drain it."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._waiting: dict[str, tuple[str, str, str]] = {}  # request id -> (model, set, header)
        self._places: dict[str, int] = {}
        self._read_at = 0.0

    def waits(self, request_id: str, model: str, waiting_set: str, header: str) -> None:
        self._waiting[request_id] = (model, waiting_set, header)

    def left(self, request_id: str) -> None:
        """The request has events, or ended: it waits no more."""
        self._waiting.pop(request_id, None)
        self._places.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    async def place(self, client: Any, queue_of: Callable[[str], str], request_id: str) -> int | None:
        """1-based place of a waiting request (0: taken); raises what the client raises."""
        every = self.poll_s / 2 * max(1.0, len(self._waiting) / POSITIONS_PER_POLL)
        if time.monotonic() - self._read_at >= every:
            self._read_at = time.monotonic()
            by_model: dict[str, list[tuple[str, str, str]]] = {}
            for rid, (model, waiting_set, header) in self._waiting.items():
                by_model.setdefault(model, []).append((rid, waiting_set, header))
            places: dict[str, int] = {}
            for model, waiting in by_model.items():  # one script per model: each queue is in its own slot
                flat = [part for _, waiting_set, header in waiting for part in (waiting_set, header)]
                got = await eval_script(client, POSITIONS, [queue_of(model)], flat)
                places |= {rid: int(p) for (rid, _, _), p in zip(waiting, got, strict=True)}
            self._places = places
        return self._places.get(request_id)
