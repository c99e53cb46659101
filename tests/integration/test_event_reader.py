"""The gateway's one event reader (server/router.py) under supervision, with a real
uvicorn and a memory broker whose event stream breaks: the reader restarts with
backoff, /health answers 503 while it is down and 200 once it reads again, and the
restarted reader routes a request's events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app
from wsllm.types import TokenEvent


def registered(broker: Any, model: str) -> Any:
    """`broker` with an engine of `model` registered (it serves nothing)."""
    broker.heartbeat(EngineInfo("e1", model, 2048))
    return broker


class FlakyBroker(MemoryBroker):
    """A memory broker whose event stream breaks the first `failures` times it is read."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        if self.failures > 0:
            self.failures -= 1
            await asyncio.sleep(0.3)
            raise RuntimeError("the event stream broke")
        async for batch in super().events():
            yield batch


def test_the_event_reader_restarts_and_health_says_when_it_is_down(
    tiny_model_dir: Path, uvicorn_thread: Any
) -> None:
    broker = registered(FlakyBroker(failures=3), "tiny")
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), GatewayConfig()) as (
        base,
        app,
    ):
        seen = set()
        deadline = time.monotonic() + 20
        while not (503 in seen and 200 in seen and broker.failures == 0):
            seen.add(httpx.get(f"{base}/health").status_code)
            assert time.monotonic() < deadline, f"/health answered only {seen}"
            time.sleep(0.02)
        while httpx.get(f"{base}/health").status_code != 200:  # it reads again after its backoff
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # and routes events again: a request's events reach it
        gw = app.state.gateway
        inbox = gw.router.open("r1")
        broker.publish([TokenEvent("r1", 0, [1], finish_reason="length")])
        deadline = time.monotonic() + 5
        while not len(inbox):
            assert time.monotonic() < deadline, "the restarted reader routes nothing"
            time.sleep(0.01)
        assert gw.router.restarts == 3
    broker.close()
