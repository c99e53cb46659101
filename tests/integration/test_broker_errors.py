"""Failures behind the gateway are answers to retry later, with a real uvicorn and no
engine behind it (a heartbeat makes the gateway think one serves): a Redis outage
during a WebSocket cancel is a `model_not_ready` error and the socket stays, and an
engine that is full (`engine_busy`) is a 503 with Retry-After, not the client's 400."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.broker.redis import RedisBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.config_redis import RedisConfig
from wsllm.server.app import create_app
from wsllm.types import TokenEvent


def registered(broker: Any, model: str) -> Any:
    """`broker` with an engine of `model` registered (it serves nothing)."""
    broker.heartbeat(EngineInfo("e1", model, 2048))
    return broker


def test_a_redis_outage_during_a_cancel_keeps_the_socket(
    redis_server: Any, tiny_model_dir: Path, uvicorn_thread: Any
) -> None:
    redis_server.client().flushall()
    rcfg = RedisConfig(engine_ttl_s=60)
    broker = RedisBroker(redis_server.url, model="tiny", cfg=rcfg)
    registered(broker, "tiny")
    cfg = GatewayConfig()
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), cfg) as (base, _):

        async def go() -> list[dict[str, Any]]:
            async with websockets.connect(base.replace("http", "ws") + "/v1/ws") as ws:
                await ws.recv()
                await ws.send(orjson.dumps({"type": "completion", "id": "a", "prompt": "hi"}).decode())
                assert orjson.loads(await ws.recv())["type"] == "started"
                redis_server.stop()
                try:
                    await ws.send(orjson.dumps({"type": "cancel", "id": "a"}).decode())
                    got = [orjson.loads(await asyncio.wait_for(ws.recv(), 30))]
                    while got[-1]["type"] not in ("done", "error"):
                        got.append(orjson.loads(await asyncio.wait_for(ws.recv(), 30)))
                    await ws.send(orjson.dumps({"type": "ping"}).decode())
                    while got[-1]["type"] != "pong":
                        got.append(orjson.loads(await asyncio.wait_for(ws.recv(), 30)))
                finally:
                    redis_server.start()
                return got

        got = asyncio.run(go())
        # The cancel is over for the client (its abort is retried later: issue 23).
        end = next(m for m in got if m["type"] in ("done", "error"))
        assert (end["type"], end["id"], end["finish_reason"]) == ("done", "a", "abort"), got
        assert got[-1]["type"] == "pong"  # the socket is still there
    broker.close()


def test_an_engine_that_is_full_is_a_503_to_retry(tiny_model_dir: Path, uvicorn_thread: Any) -> None:
    """`engine_busy` (the engine cannot take the request now) is not the client's fault:
    503 with Retry-After, not 400. The engine side is driven by hand."""
    broker = registered(MemoryBroker(), "tiny")
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), GatewayConfig()) as (
        base,
        _,
    ):

        async def go() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as http:
                answer = asyncio.create_task(http.post(f"{base}/v1/completions", json={"prompt": "hi"}))
                pulled: list[Any] = []
                while not pulled:
                    pulled = await asyncio.to_thread(broker.pull, 1, 0.1)
                rid = pulled[0].request_id
                broker.publish([TokenEvent.failure(rid, "engine_busy", "the engine is full; retry later")])
                return await answer

        r = asyncio.run(go())
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "engine_busy"
    broker.close()
