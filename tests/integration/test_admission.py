"""Admission: 503 while no engine serves, 429 with Retry-After when the queue is full.
No worker runs here, so requests stay queued in the broker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app

BODY = {"prompt": "hi", "max_tokens": 4, "stream": True}


def test_not_ready_then_queue_full(tiny_model_dir: Path, uvicorn_thread: Any) -> None:
    broker = MemoryBroker(max_queue_depth=1)
    cfg = GatewayConfig(max_queue_depth=1, heartbeat_s=0.05)
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), cfg) as (base, _):
        r = httpx.get(f"{base}/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = httpx.post(f"{base}/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"

        broker.heartbeat(EngineInfo("e1", "tiny", 2048))  # an engine appears (and never pulls)
        assert httpx.get(f"{base}/ready").status_code == 200

        async def fill_then_overflow() -> tuple[bytes, httpx.Response]:
            async with (
                httpx.AsyncClient(base_url=base) as http,
                http.stream("POST", "/v1/completions", json=BODY) as first,
            ):
                assert first.status_code == 200
                chunks = first.aiter_raw()  # keep a reference: a dropped iterator closes the stream
                keepalive = await chunks.__anext__()  # it waits in the queue
                second = await http.post("/v1/completions", json=BODY | {"stream": False}, timeout=10)
                await chunks.aclose()
                return keepalive, second

        keepalive, second = asyncio.run(fill_then_overflow())
        assert keepalive.startswith(b": keepalive")
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "queue_full"
        # which bound refused it, never how deep the queue is (another tenant's load)
        assert not any(c.isdigit() for c in second.json()["error"]["message"]), second.text
        deadline = time.monotonic() + 10  # the first client left: its request leaves the queue
        while asyncio.run(broker.pending()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    broker.close()


def test_a_request_that_waits_past_the_queue_timeout_gets_503_queue_timeout(
    tiny_model_dir: Path, live_server: Any
) -> None:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=1, dtype="float32")
    )
    long = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def go(base: str) -> tuple[httpx.Response, float, httpx.Response, int]:
        async with (
            httpx.AsyncClient(base_url=base, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=long) as first,
        ):
            lines = first.aiter_lines()  # the one sequence the engine runs
            async for line in lines:
                if line.startswith("data: {"):  # it runs: the engine's only sequence is taken
                    break
            t0 = time.monotonic()
            late = await http.post("/v1/completions", json=BODY | {"stream": False})
            waited = time.monotonic() - t0
            # its place is free again: the queue (depth 1) takes the next one (no 429) and, the
            # engine being still busy, times it out too
            again = await http.post("/v1/completions", json=BODY | {"stream": False})
            more = 0
            async for line in lines:  # the running request was never disturbed
                more += line.startswith("data: {")
                if more >= 5:
                    break
        return late, waited, again, more

    with live_server(engine, queue_timeout_s=0.4, max_queue_depth=1) as srv:
        late, waited, again, more = asyncio.run(go(srv.base_url))
    assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
    assert late.headers["retry-after"] == "1"
    assert 0.4 <= waited < 5
    assert again.status_code == 503 and again.json()["error"]["code"] == "queue_timeout"
    assert more == 5


def test_a_higher_priority_request_overtakes_the_queue(tiny_model_dir: Path, live_server: Any) -> None:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=1, dtype="float32")
    )
    long = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    short = BODY | {"stream": False, "max_tokens": 2}
    done: list[str] = []

    async def go(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:

            async def send(name: str, priority: int) -> None:
                r = await http.post("/v1/completions", json=short | {"priority": priority})
                assert r.status_code == 200, r.text
                done.append(name)

            async with http.stream("POST", "/v1/completions", json=long) as first:
                lines = first.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):  # it runs: the engine's only sequence is taken
                        break
                tasks = [asyncio.create_task(send("low", 0))]
                while await srv.broker.pending() < 1:  # queued in this order
                    await asyncio.sleep(0.01)
                tasks.append(asyncio.create_task(send("high", 5)))
                while await srv.broker.pending() < 2:
                    await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)  # the long one was cancelled by leaving its stream

    with live_server(engine, max_priority=10) as srv:
        asyncio.run(go(srv.base_url))
    assert done == ["high", "low"]
