"""The in-process broker: one gateway and one or more engine worker threads in one
process (`wsllm serve`).

Everything is guarded by one `threading.Lock`, held only for a few list operations,
so the asyncio side never waits on the engine. The worker thread wakes the loop with
`call_soon_threadsafe`, and only when the reader task is actually waiting. Both
queues are bounded: `submit` raises QueueFull past `max_pending`, and `publish`
blocks the worker (backpressure) while `max_event_batches` batches are unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from threading import Condition, Lock
from typing import Any

from wsllm.broker.base import Broker, BrokerClosed, EngineInfo, QueueFull, Rank
from wsllm.types import ERR_QUEUE_TIMEOUT, GenerateRequest, TokenEvent

log = logging.getLogger(__name__)

# How often a blocked engine-side call re-checks whether the broker was closed.
_POLL_S = 0.1
# How often the engine side looks for waiting requests past their queue deadline.
_EXPIRY_CHECK_S = 0.05


class MemoryBroker(Broker):
    def __init__(
        self, max_pending: int = 256, max_event_batches: int = 1024, max_aborts: int = 65536
    ) -> None:
        if max_pending < 1 or max_event_batches < 1:
            raise ValueError("max_pending and max_event_batches must be >= 1")
        self.max_pending = max_pending
        self.max_event_batches = max_event_batches
        self._lock = Lock()
        self._has_pending = Condition(self._lock)  # signalled by submit
        self._has_space = Condition(self._lock)  # signalled when the reader drains events
        self._pending: OrderedDict[str, GenerateRequest] = OrderedDict()
        self._aborts: deque[str] = deque(maxlen=max_aborts)
        self._events: deque[list[TokenEvent]] = deque()
        self._engines: dict[str, EngineInfo] = {}
        #: what engines could not serve at all, with the reason (the last few)
        self.dead_letters: deque[tuple[object, str]] = deque(maxlen=1000)
        self._closed = False
        # The reader task's loop and wake-up event; set while events() runs.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._reader_waiting = False
        self._next_expiry_check = 0.0

    # -- gateway side ----------------------------------------------------------------

    async def submit(
        self,
        request: GenerateRequest,
        *,
        max_waiting: int | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        # context serves resuming, which this broker does not do.
        cap = self.max_pending if max_waiting is None else min(max_waiting, self.max_pending)
        with self._lock:
            if self._closed:
                raise BrokerClosed("the broker is closed")
            if len(self._pending) >= cap:
                raise QueueFull(f"{len(self._pending)} requests are already waiting for an engine")
            if request.request_id in self._pending:
                raise ValueError(f"request id {request.request_id!r} is already queued")
            self._pending[request.request_id] = request
            self._has_pending.notify()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                # Pulled already (or never seen): the engine drops it on its next step.
                self._aborts.append(request_id)

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        with self._lock:
            if self._wakeup is not None:
                raise RuntimeError("MemoryBroker.events() has one consumer and it is already running")
            self._loop = asyncio.get_running_loop()
            wakeup = self._wakeup = asyncio.Event()
        try:
            while True:
                with self._lock:
                    batches = list(self._events)
                    self._events.clear()
                    closed = self._closed
                    if batches:
                        self._has_space.notify_all()
                    elif not closed:
                        self._reader_waiting = True
                        wakeup.clear()
                for batch in batches:
                    yield batch
                if batches:
                    continue
                if closed:
                    return
                await wakeup.wait()
        finally:
            with self._lock:
                self._loop = self._wakeup = None
                self._reader_waiting = False

    async def engines(self) -> list[EngineInfo]:
        with self._lock:
            return self._alive(list(self._engines.values()))

    async def pending(self) -> int:
        return len(self._pending)

    # -- engine side -------------------------------------------------------------------

    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        self._expire()  # also when the engines are full: that is when requests wait
        if max_n <= 0:
            return []
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._pending and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._has_pending.wait(min(remaining, _POLL_S))
            if (
                rank is not None and len(self._pending) > max_n
            ):  # the engine's best, oldest first among equals
                best = heapq.nsmallest(
                    max_n, enumerate(self._pending.values()), key=lambda ir: (rank(ir[1]), ir[0])
                )
                return [self._pending.pop(r.request_id) for _, r in best]
            out: list[GenerateRequest] = []
            while self._pending and len(out) < max_n:
                out.append(self._pending.popitem(last=False)[1])
            return out

    def _expire(self) -> None:
        """End the waiting requests that are past their queue deadline, freeing their
        places: each gets a `queue_timeout` failure as its only event."""
        now = time.time()
        with self._lock:
            if now < self._next_expiry_check or self._closed:
                return
            self._next_expiry_check = now + _EXPIRY_CHECK_S
            expired = [r for r in self._pending.values() if r.expired(now)]
            if not expired:
                return
            for r in expired:
                del self._pending[r.request_id]
            waited = [f"{now - r.arrival_time:.1f}" if r.arrival_time else "?" for r in expired]
            self._events.append(
                [
                    TokenEvent.failure(
                        r.request_id,
                        ERR_QUEUE_TIMEOUT,
                        f"no engine took this request in time (waited {w} s)",
                        0,
                    )
                    for r, w in zip(expired, waited, strict=True)
                ]
            )
            self._wake_reader()
        log.info("%d requests waited past their queue deadline", len(expired))

    def aborts(self) -> list[str]:
        with self._lock:
            out = list(dict.fromkeys(self._aborts))
            self._aborts.clear()
            return out

    def publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        with self._lock:
            while len(self._events) >= self.max_event_batches and not self._closed:
                self._has_space.wait(_POLL_S)
            if self._closed:
                log.debug("broker closed; dropping %d events", len(events))
                return
            self._events.append(list(events))
            self._wake_reader()

    def dead_letter(self, item: object, reason: str) -> None:
        log.error("dead letter (%s): %r", reason, item)
        with self._lock:
            self.dead_letters.append((item, reason))

    def heartbeat(self, info: EngineInfo) -> None:
        d = info.to_dict()
        d["stats"] = dict(info.stats)
        d["last_seen"] = time.time()
        with self._lock:
            self._engines[info.engine_id] = EngineInfo.from_dict(d)

    def deregister(self, engine_id: str) -> None:
        with self._lock:
            self._engines.pop(engine_id, None)

    # -- both ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._has_pending.notify_all()
            self._has_space.notify_all()
            self._wake_reader()

    def _wake_reader(self) -> None:
        """Wake the reader task if it sleeps. Call with the lock held."""
        if not self._reader_waiting or self._loop is None or self._wakeup is None:
            return
        self._reader_waiting = False
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read
            self._loop.call_soon_threadsafe(self._wakeup.set)
