"""The in-process broker: one gateway and one or more engine worker threads in one
process (`wsllm serve`).

Several models in one process (`wsllm serve --model A --model B`): each model's
engine pulls through `engine_side(model)`, a view of this broker that takes only the
requests whose `model` it serves and sees every abort. The broker itself, used as an
engine side, takes any request (one model, the default).

Everything is guarded by one `threading.Lock`, held only for a few list operations,
so the asyncio side never waits on the engine. The worker thread wakes the loop with
`call_soon_threadsafe`, and only when the reader task is actually waiting. Both
queues are bounded: `submit` raises QueueFull past `max_queue_depth` (or past the
tenant's share of it), and `publish` blocks the worker (backpressure) while
`max_event_batches` batches are unread. Waiting requests are taken by priority, then
round robin by tenant (`fair_queue.py`, the same rules as the Redis queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from threading import Condition, Lock
from typing import Any

from wsllm.broker.base import Broker, BrokerClosed, EngineBroker, QueueFull, Rank
from wsllm.broker.fair_queue import FairQueue
from wsllm.types import (
    ERR_QUEUE_TIMEOUT,
    AdapterCommand,
    AdapterReply,
    EngineInfo,
    GenerateRequest,
    TokenEvent,
)

log = logging.getLogger(__name__)

# How often a blocked engine-side call re-checks whether the broker was closed.
_POLL_S = 0.1
# How often the engine side looks for waiting requests past their queue deadline.
_EXPIRY_CHECK_S = 0.05


class MemoryBroker(Broker):
    def __init__(
        self,
        max_queue_depth: int = 256,
        max_event_batches: int = 1024,
        max_aborts: int = 65536,
        max_queue_share: float = 1.0,
    ) -> None:
        if max_queue_depth < 1 or max_event_batches < 1:
            raise ValueError("max_queue_depth and max_event_batches must be >= 1")
        self.max_queue_depth = max_queue_depth
        self.max_event_batches = max_event_batches
        self._lock = Lock()
        # signalled by submit: the engines of any model (None) and of the request's model;
        # an engine of another model sleeps on (a submit for A never wakes B's puller)
        self._has_pending: dict[str | None, Condition] = {None: Condition(self._lock)}
        self._has_space = Condition(self._lock)  # signalled when the reader drains events
        self._pending = FairQueue(max_queue_depth, max_queue_share)
        self._max_aborts = max_aborts
        # one queue of abort ids per engine side: every engine sees every abort
        self._aborts: dict[str | None, deque[str]] = {None: deque(maxlen=max_aborts)}
        # adapter commands per engine side, as aborts; the replies per command the gateway awaits
        self._commands: dict[str | None, deque[AdapterCommand]] = {None: deque(maxlen=64)}
        self._replies: dict[str, list[AdapterReply]] = {}
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
        context: dict[str, Any] | None = None,
    ) -> None:
        # context serves resuming, which this broker does not do.
        with self._lock:
            if self._closed:
                raise BrokerClosed("the broker is closed")
            if (refused := self._pending.refusal(request)) is not None:
                raise QueueFull(refused)
            self._pending.push(request)
            for key in (None, request.model):
                if (cond := self._has_pending.get(key)) is not None:
                    cond.notify_all()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            if self._pending.remove(request_id) is None:
                # Pulled already (or never seen): the engine drops it on its next step.
                for q in self._aborts.values():
                    q.append(request_id)

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

    async def command(
        self, model: str, command: AdapterCommand, engines: int, timeout: float
    ) -> list[AdapterReply]:
        with self._lock:  # to the side of `model`'s engines, or the broker's own (one model)
            self._commands[model if model in self._commands else None].append(command)
            got = self._replies[command.command_id] = []
        deadline = time.monotonic() + timeout
        try:
            while len(got) < engines and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the worker answers between its steps
            with self._lock:
                return list(got)
        finally:
            with self._lock:
                del self._replies[command.command_id]

    # -- engine side -------------------------------------------------------------------

    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        return self._pull(max_n, timeout, rank, None)

    def engine_side(self, model: str) -> EngineBroker:
        """The engine side of one model's engines: `pull` takes only the requests for
        `model`. Register each model's view before the gateway submits."""
        with self._lock:
            self._aborts.setdefault(model, deque(maxlen=self._max_aborts))
            self._commands.setdefault(model, deque(maxlen=64))
            self._has_pending.setdefault(model, Condition(self._lock))
        return _ModelSide(self, model)

    def _pull(
        self, max_n: int, timeout: float, rank: Rank | None, model: str | None
    ) -> list[GenerateRequest]:
        self._expire()  # also when the engines are full: that is when requests wait
        if max_n <= 0:
            return []
        deadline = time.monotonic() + timeout

        # Priority first, then tenants by the engine's rank and in turn (fair_queue.py).
        def mine(r: GenerateRequest) -> bool:
            return model is None or r.model == model

        with self._lock:
            while not self._closed:
                if out := self._pending.take(max_n, mine, rank):
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._has_pending[model].wait(min(remaining, _POLL_S))
            return []

    def _expire(self) -> None:
        """End the waiting requests that are past their queue deadline, freeing their
        places: each gets a `queue_timeout` failure as its only event."""
        now = time.time()
        with self._lock:
            if now < self._next_expiry_check or self._closed:
                return
            self._next_expiry_check = now + _EXPIRY_CHECK_S
            expired = [r for r in self._pending if r.expired(now)]
            if not expired:
                return
            for r in expired:
                self._pending.remove(r.request_id)
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
        return self._aborts_of(None)

    def commands(self) -> list[AdapterCommand]:
        return self._commands_of(None)

    def _commands_of(self, model: str | None) -> list[AdapterCommand]:
        with self._lock:
            q = self._commands[model]
            out = list(q)
            q.clear()
            return out

    def reply(self, reply: AdapterReply) -> None:
        with self._lock:
            if (got := self._replies.get(reply.command_id)) is not None:
                got.append(reply)

    def _aborts_of(self, model: str | None) -> list[str]:
        with self._lock:
            q = self._aborts[model]
            out = list(dict.fromkeys(q))
            q.clear()
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
            for cond in self._has_pending.values():
                cond.notify_all()
            self._has_space.notify_all()
            self._wake_reader()

    def _wake_reader(self) -> None:
        """Wake the reader task if it sleeps. Call with the lock held."""
        if not self._reader_waiting or self._loop is None or self._wakeup is None:
            return
        self._reader_waiting = False
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read
            self._loop.call_soon_threadsafe(self._wakeup.set)


class _ModelSide(EngineBroker):
    """One model's engine side of a shared MemoryBroker (see `engine_side`): its own
    pull filter and abort queue; everything else is the broker's."""

    def __init__(self, hub: MemoryBroker, model: str) -> None:
        self.hub = hub
        self.model = model

    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        return self.hub._pull(max_n, timeout, rank, self.model)

    def aborts(self) -> list[str]:
        return self.hub._aborts_of(self.model)

    def commands(self) -> list[AdapterCommand]:
        return self.hub._commands_of(self.model)

    def reply(self, reply: AdapterReply) -> None:
        self.hub.reply(reply)

    def publish(self, events: list[TokenEvent]) -> None:
        self.hub.publish(events)

    def heartbeat(self, info: EngineInfo) -> None:
        self.hub.heartbeat(info)

    def deregister(self, engine_id: str) -> None:
        self.hub.deregister(engine_id)

    def dead_letter(self, item: object, reason: str) -> None:
        self.hub.dead_letter(item, reason)

    def close(self) -> None:
        self.hub.close()
