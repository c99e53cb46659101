"""The one reader of `broker.events()`: it fans TokenEvents out by request id to one
bounded `Inbox` per request.

The reader is supervised: if reading fails, it logs, marks itself down (`/health`
answers 503 meanwhile) and starts again with exponential backoff. Events of requests
nobody follows (cancelled) are dropped. An inbox that fills up (its client stopped
reading) is cut off: the request's `Generation` then fails it with `slow_consumer`,
so one slow client never makes the gateway hold more than `max_buffered_events` per
request."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from wsllm.broker.base import Broker
from wsllm.types import TokenEvent

log = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 5.0


class Inbox:
    """The events of one request that its reader has not taken yet (at most `cap`)."""

    __slots__ = ("_events", "_wakeup", "cap", "overflowed", "woken")

    def __init__(self, cap: int) -> None:
        self._events: deque[TokenEvent] = deque()
        self._wakeup = asyncio.Event()
        self.cap = cap
        self.overflowed = False  # the reader fell `cap` events behind: nothing more comes
        self.woken = False  # wake() was called (a cancel): the reader stops waiting

    def put(self, ev: TokenEvent) -> bool:
        """Queue `ev`; False (and `overflowed`) when the inbox is full."""
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

    def __len__(self) -> int:
        return len(self._events)

    async def take(self, timeout: float | None) -> list[TokenEvent]:
        """Every queued event, waiting up to `timeout` for the first; [] on timeout or
        after wake()."""
        if not self._events and not self.overflowed and not self.woken:
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
    def __init__(self, broker: Broker, max_buffered_events: int) -> None:
        self.broker = broker
        self.max_buffered_events = max_buffered_events
        self._inboxes: dict[str, Inbox] = {}
        self.up = False  # the reader is reading (False while it restarts)
        self.restarts = 0

    def open(self, request_id: str) -> Inbox:
        """Route `request_id`'s events to a new inbox. A request followed again (its
        owner resumed it on another connection) leaves the old inbox: its reader
        is woken, and finds it no longer routed (`routes_to`)."""
        inbox = Inbox(self.max_buffered_events)
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
        """Read until the broker closes, restarting the read when it fails."""
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
