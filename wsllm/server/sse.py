"""Server-Sent Events as a pure ASGI response, and the disconnect watch that both
streamed and plain HTTP answers use: when the client leaves, the work stops and
the engine request is aborted (`on_close`). A client that takes no data for
`send_timeout_s` is treated as gone (`on_timeout` counts it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

log = logging.getLogger(__name__)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client goes first. Returns (completed, result); when the
    client left, `work` is cancelled and (False, None) comes back."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if task.done() and not task.cancelled():
        return True, task.result()
    return False, None


class EventStream(Response):
    """`text/event-stream` from an async iterator of ready-made SSE frames (bytes).
    `on_close` runs however the stream ends: finished, failed or client gone."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        send_timeout_s: float,
        on_timeout: Callable[[], None] = lambda: None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.frames = frames
        self.on_close = on_close
        self.send_timeout_s = send_timeout_s
        self.on_timeout = on_timeout
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"} | (headers or {}))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await until_disconnect(receive, self._pump(send))
        except OSError:  # the socket broke while sending
            pass
        finally:
            await self.on_close()

    async def _pump(self, send: Send) -> None:
        try:
            async for frame in self.frames:
                async with asyncio.timeout(self.send_timeout_s):  # a client that stopped reading
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            log.warning("an SSE client took no data for %.0fs; dropping it", self.send_timeout_s)
            self.on_timeout()


def frame(event_id: int, data: bytes) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (event_id, data)


KEEPALIVE = b": keepalive\n\n"
DONE = b"data: [DONE]\n\n"
