"""Every request ends, whatever its engine or the broker does (issue 23): the gateway's
own deadline (`--orphan-timeout-s`) and a WebSocket request whose abort fails.

A real gateway (uvicorn) on the memory broker, with the engine side driven by hand
from the test: a heartbeat says that an engine serves the model, and the test pulls
and publishes what an engine would, then falls silent as a killed engine does. The
same faults with real processes on Redis are in test_chaos.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets
from tokenizers import Tokenizer

from wsllm.broker.base import BrokerUnavailable
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app
from wsllm.types import EngineInfo, GenerateRequest, TokenEvent

MODEL = "tiny"
ORPHAN_S = 1.0


class Heartbeat:
    """An engine that says it is alive every 0.1 s until `stop()`, as a worker does."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.broker.heartbeat(EngineInfo("e1", MODEL, 2048))
            self.done.wait(0.1)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@pytest.fixture
def gateway(tiny_model_dir: Path, uvicorn_thread: Any) -> Iterator[tuple[str, MemoryBroker, Heartbeat]]:
    broker = MemoryBroker()
    broker.engine_ttl_s = 0.5  # a silent engine is seen gone within half a second
    beat = Heartbeat(broker)
    cfg = GatewayConfig(orphan_timeout_s=ORPHAN_S, heartbeat_s=0.5, frontend=False)
    try:
        with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, MODEL), cfg) as (base, _):
            yield base, broker, beat
    finally:
        beat.stop()
        broker.close()


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1000} | kw


async def pull_one(broker: MemoryBroker) -> GenerateRequest:
    (req,) = await asyncio.to_thread(broker.pull, 1, 10.0)
    return req


async def sse_until_end(http: httpx.AsyncClient, base: str, b: dict[str, Any]) -> list[dict[str, Any]]:
    """The data chunks of a streamed completion, to its [DONE]."""
    chunks = []
    async with http.stream("POST", f"{base}/v1/completions", json=b | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: "):
                chunks.append(orjson.loads(line[6:]))
    raise AssertionError(f"the stream closed without [DONE]: {chunks}")


def test_a_request_whose_engine_goes_silent_ends_with_worker_lost(
    gateway: tuple[str, MemoryBroker, Heartbeat],
) -> None:
    """A streamed, a non-streamed and a WebSocket request get one event each from their
    engine, which then dies: each ends with `worker_lost` within the deadline (503 with
    Retry-After for the plain call), and the engine is told to drop them."""
    base, broker, beat = gateway

    async def engine() -> list[str]:
        rids = []
        for _ in range(3):
            req = await pull_one(broker)
            broker.publish([TokenEvent(req.request_id, 0, [42])])
            rids.append(req.request_id)
        await asyncio.sleep(0.2)
        beat.stop()  # kill -9: no heartbeat, no event, no answer
        return rids

    async def ws() -> dict[str, Any]:
        async with websockets.connect(base.replace("http", "ws") + "/v1/ws") as sock:
            await sock.recv()  # hello
            await sock.send(orjson.dumps({"type": "completion", "id": "w"} | body()).decode())
            while True:
                msg = orjson.loads(await sock.recv())
                if msg["type"] in ("done", "error"):
                    return dict(msg)

    async def go() -> tuple[Any, ...]:
        async with httpx.AsyncClient(timeout=30) as http, asyncio.timeout(20):
            start = time.monotonic()
            return (
                *await asyncio.gather(
                    engine(),
                    sse_until_end(http, base, body()),
                    http.post(f"{base}/v1/completions", json=body()),
                    ws(),
                ),
                time.monotonic() - start,
            )

    rids, chunks, plain, ws_end, took = asyncio.run(go())
    assert chunks[-1]["error"]["code"] == "worker_lost", chunks[-1]
    assert plain.status_code == 503 and plain.headers["retry-after"] == "1", plain.text
    assert plain.json()["error"]["code"] == "worker_lost"
    assert (ws_end["type"], ws_end["code"], ws_end["retry_after_s"]) == ("error", "worker_lost", 1)
    # the engine's last sign of life, then the deadline and a watchdog tick or two
    assert took < 0.2 + 0.5 + ORPHAN_S + 2.0, took
    assert sorted(broker.aborts()) == sorted(rids)  # a revived engine would drop them


def test_a_queued_request_ends_when_its_model_has_no_engine(
    gateway: tuple[str, MemoryBroker, Heartbeat],
) -> None:
    """Nothing ever takes the request and the model's only engine stops heartbeating:
    `worker_lost`, and the request leaves the queue."""
    base, broker, beat = gateway

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as http, asyncio.timeout(20):
            task = asyncio.create_task(http.post(f"{base}/v1/completions", json=body()))
            while not await broker.pending():
                await asyncio.sleep(0.01)
            beat.stop()
            return await task

    r = asyncio.run(go())
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_lost", r.text
    assert asyncio.run(broker.pending()) == 0


def test_a_request_queued_behind_others_is_not_cut(gateway: tuple[str, MemoryBroker, Heartbeat]) -> None:
    """A live engine that is busy leaves a request waiting three deadlines long: it is
    not cut, and it gets its whole answer when the engine takes it."""
    base, broker, _ = gateway

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=30) as http, asyncio.timeout(20):
            task = asyncio.create_task(sse_until_end(http, base, body(max_tokens=2)))
            await asyncio.sleep(3 * ORPHAN_S)
            assert not task.done(), task.result()
            req = await pull_one(broker)
            broker.publish([TokenEvent(req.request_id, 0, [42])])
            await asyncio.sleep(0.5 * ORPHAN_S)  # a step's pause, under the deadline
            broker.publish([TokenEvent(req.request_id, 1, [43], finish_reason="length")])
            return await task

    chunks = asyncio.run(go())
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"], chunks


class AbortFails(MemoryBroker):
    """The memory broker, but every abort fails as an unreachable Redis's would."""

    def __init__(self) -> None:
        super().__init__()
        self.abort_calls = 0

    async def abort(self, request_id: str) -> None:
        self.abort_calls += 1
        raise BrokerUnavailable("redis is unreachable: connection refused")


def test_a_websocket_request_ends_with_done_when_the_abort_after_a_stop_string_fails(
    tiny_model_dir: Path, uvicorn_thread: Any
) -> None:
    """The stop string ends the answer while the engine still runs it; the abort that
    tells the engine fails. The client still gets its `done`, and the abort is tried
    again later."""
    broker = AbortFails()
    broker.heartbeat(EngineInfo("e1", MODEL, 2048))
    ids = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode("hello world again").ids
    msg = {"type": "completion", "id": "s", "prompt": "x", "max_tokens": 100, "stop": ["world"]}

    async def go(base: str) -> list[dict[str, Any]]:
        async with websockets.connect(base.replace("http", "ws") + "/v1/ws") as sock, asyncio.timeout(10):
            await sock.recv()  # hello
            await sock.send(orjson.dumps(msg).decode())
            req = await pull_one(broker)
            broker.publish([TokenEvent(req.request_id, 0, ids)])
            got = []
            while not got or got[-1]["type"] not in ("done", "error"):
                got.append(orjson.loads(await sock.recv()))
            await sock.send(orjson.dumps({"type": "ping"}).decode())
            got.append(orjson.loads(await sock.recv()))
            return got

    cfg = GatewayConfig(frontend=False)
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, MODEL), cfg) as (base, _):
        got = asyncio.run(go(base))
        deadline = time.monotonic() + 5
        while broker.abort_calls < 2:  # the first, then its retry (after the grace time: 0 here)
            assert time.monotonic() < deadline, broker.abort_calls
            time.sleep(0.01)
    broker.close()
    text = "".join(m["text"] for m in got if m["type"] == "delta")
    assert text == "hello ", got
    assert [m["type"] for m in got][-2:] == ["done", "pong"], got
    assert got[-2]["finish_reason"] == "stop"
