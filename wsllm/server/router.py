"""The one reader of `broker.events()`: it fans TokenEvents out by request id to one
bounded `Inbox` per request.

The reader is supervised: if reading fails, it logs, marks itself down (`/health`
answers 503 meanwhile) and starts again with exponential backoff. Events of requests
nobody follows (cancelled) are dropped. An inbox that fills up (its client stopped
reading) is cut off: the request's `Generation` then fails it with `slow_consumer`,
so one slow client never makes the gateway hold more than `max_buffered_events` per
request.

Beside the reader, a watchdog gives every followed request a deadline of its own
(`orphan_timeout_s`): a request is orphaned when its model has had no live engine for
that long, or when it started (an event came) and then nothing came for that long.
A request that has had no event yet waits in a queue (the broker's or its engine's)
behind others and is never cut for waiting while an engine lives: engines expire
queued requests themselves (`queue_timeout_s`). Its Generation then ends it with
`worker_lost` (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from wsllm.broker.base import GatewayBroker
from wsllm.types import TokenEvent

log = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 5.0


class Inbox:
    """The events of one request that its reader has not taken yet (at most `cap`)."""

    __slots__ = (
        "_events",
        "_wakeup",
        "cap",
        "model",
        "moved_at",
        "orphaned",
        "overflowed",
        "started",
        "woken",
    )

    def __init__(self, cap: int, model: str = "") -> None:
        self._events: deque[TokenEvent] = deque()
        self._wakeup = asyncio.Event()
        self.cap = cap
        self.model = model  # the served model's name ("": any engine serves it)
        self.overflowed = False  # the reader fell `cap` events behind: nothing more comes
        self.woken = False  # wake() was called (a cancel): the reader stops waiting
        self.started = False  # an event came: the request left its queue
        self.moved_at = time.monotonic()  # when it was opened, or its latest event came
        self.orphaned: str | None = None  # why nothing will answer it (the watchdog said)

    def put(self, ev: TokenEvent) -> bool:
        """Queue `ev`; False (and `overflowed`) when the inbox is full."""
        self.started = True
        self.moved_at = time.monotonic()
        if len(self._events) >= self.cap:
            self.overflowed = True
            self._wakeup.set()
            return False
        self._events.append(ev)
        self._wakeup.set()
        return True

    def wake(self) -> None:
        self.woken = True
        self._wakeup.set()

    def orphan(self, why: str) -> None:
        """Nothing will answer this request: its reader wakes and ends it."""
        self.orphaned = why
        self._wakeup.set()

    def __len__(self) -> int:
        return len(self._events)

    async def take(self, timeout: float | None) -> list[TokenEvent]:
        """Every queued event, waiting up to `timeout` for the first; [] on timeout or
        after wake()."""
        if not self._events and not self.overflowed and not self.woken and self.orphaned is None:
            self._wakeup.clear()
            try:
                async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                    await self._wakeup.wait()
            except TimeoutError:
                return []
        out = list(self._events)
        self._events.clear()
        return out


class Router:
    def __init__(
        self, broker: GatewayBroker, max_buffered_events: int, orphan_timeout_s: float = 30.0
    ) -> None:
        self.broker = broker
        self.max_buffered_events = max_buffered_events
        self.orphan_timeout_s = orphan_timeout_s
        self._inboxes: dict[str, Inbox] = {}
        self.up = False  # the reader is reading (False while it restarts)
        self.restarts = 0
        #: model -> time.monotonic() when the broker last listed a live engine of it ("":
        #: an engine that names no model, which may serve any; None: any engine at all)
        self._engine_seen: dict[str | None, float] = {}

    def open(self, request_id: str, model: str = "") -> Inbox:
        """Route `request_id` (a request for `model`)'s events to a new inbox. A request
        followed again (its owner resumed it on another connection) leaves the old
        inbox: its reader is woken, and finds it no longer routed (`routes_to`)."""
        inbox = Inbox(self.max_buffered_events, model)
        old = self._inboxes.get(request_id)
        self._inboxes[request_id] = inbox
        if old is not None:
            old.wake()
        return inbox

    def routes_to(self, request_id: str, inbox: Inbox) -> bool:
        return self._inboxes.get(request_id) is inbox

    def close(self, request_id: str, inbox: Inbox | None = None) -> None:
        """Stop routing `request_id`. With `inbox`, only if that inbox still receives
        it: a request resumed on a new connection belongs to the new one."""
        if inbox is not None and self._inboxes.get(request_id) is not inbox:
            return
        self._inboxes.pop(request_id, None)
        self.broker.forget(request_id)

    def __len__(self) -> int:
        return len(self._inboxes)

    def request_ids(self) -> list[str]:
        """The requests followed now (tests, debugging)."""
        return list(self._inboxes)

    def buffered_events(self) -> int:
        """Events held for readers that have not taken them (all requests)."""
        return sum(len(i) for i in self._inboxes.values())

    async def run(self) -> None:
        """Read until the broker closes, restarting the read when it fails; the
        watchdog runs beside the reader."""
        watchdog = asyncio.create_task(self.watch(), name="wsllm-orphan-watchdog")
        try:
            await self._read()
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog

    async def _read(self) -> None:
        backoff = _MIN_BACKOFF_S
        try:
            while True:
                try:
                    self.up = True
                    async for batch in self.broker.events():
                        self.route(batch)
                        backoff = _MIN_BACKOFF_S
                    return  # the broker closed
                except Exception:
                    self.up = False
                    self.restarts += 1
                    log.exception("the event reader failed; restarting it in %.2fs", backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
        finally:
            self.up = False
            # The broker closed (or the app stops): nothing will feed the open requests.
            for rid, inbox in self._inboxes.items():
                inbox.put(TokenEvent.lost(rid, "the engine connection closed"))

    def route(self, batch: list[TokenEvent]) -> None:
        for ev in batch:
            inbox = self._inboxes.get(ev.request_id)
            if inbox is not None and not inbox.put(ev):
                log.warning(
                    "request %s: its reader is %d events behind; cutting it off", ev.request_id, inbox.cap
                )
                self.close(ev.request_id, inbox)

    # -- the orphan deadline -------------------------------------------------------------------

    async def watch(self) -> None:
        """Every tick (a quarter of the deadline, at most a second), orphan the requests
        that nothing will answer."""
        tick = min(1.0, max(0.05, self.orphan_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            try:
                live = {e.model or "" for e in await self.broker.engines()}
            except Exception:  # the broker cannot tell now: the quiet-time rule still holds
                log.debug("no engine list for the orphan watchdog", exc_info=True)
                live = None
            self.sweep(live, time.monotonic())

    def sweep(self, live_models: set[str] | None, now: float) -> list[str]:
        """Orphan the requests past their deadline, given the models with a live engine
        now (None: unknown). Returns their ids."""
        seen_at = self._engine_seen
        for model in live_models or ():
            seen_at[model] = now
        if live_models:
            seen_at[None] = now
        limit = self.orphan_timeout_s
        ended = []
        for rid, inbox in self._inboxes.items():
            if inbox.orphaned is not None or inbox.overflowed:
                continue
            engine = seen_at.get(inbox.model or None, 0.0)
            seen = max(engine, seen_at.get("", 0.0), inbox.moved_at)
            if now - seen >= limit:
                inbox.orphan(f"no engine of this model has been live for {limit:g}s")
            elif inbox.started and now - inbox.moved_at >= limit:
                inbox.orphan(f"nothing came from this request's engine for {limit:g}s: it was lost")
            else:
                continue
            log.warning("request %s: %s; ending it", rid, inbox.orphaned)
            ended.append(rid)
        return ended
