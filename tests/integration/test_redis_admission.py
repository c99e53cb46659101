"""Admission on the Redis broker, with a gateway in this process and an engine that
registers but never pulls: /ready and /v1/models follow the registry, WebSocket
requests that wait are told their place in the queue, a full queue answers 429 with
Retry-After, and a client that leaves takes its waiting requests out of the queue
once the resume grace time has passed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets

from wsllm.broker.base import EngineInfo
from wsllm.broker.redis import RedisBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.config_redis import RedisConfig
from wsllm.server.app import create_app

RCFG = RedisConfig(queue_poll_s=0.1, resume_grace_s=0.3, engine_ttl_s=30)


def test_queue_positions_429_and_the_registry(
    redis_server: Any, tiny_model_dir: Path, uvicorn_thread: Any
) -> None:
    redis_server.client().flushall()
    broker = RedisBroker(redis_server.url, model="tiny", cfg=RCFG, max_queue_depth=3)
    engine = RedisBroker(redis_server.url, model="tiny", cfg=RCFG, engine_id="puller")
    cfg = GatewayConfig(heartbeat_s=0.2)
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), cfg) as (base, _):
        assert httpx.get(f"{base}/ready").status_code == 503
        assert httpx.get(f"{base}/v1/models").json()["data"] == []
        engine.heartbeat(EngineInfo("puller", "tiny", 2048))
        deadline = time.monotonic() + 5  # gateways cache the registry for a moment
        while httpx.get(f"{base}/ready").status_code != 200:
            assert time.monotonic() < deadline, "the engine's heartbeat did not make the gateway ready"
            time.sleep(0.05)
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["tiny"]

        pulled: list[Any] = []

        async def go() -> tuple[list[dict[str, Any]], httpx.Response, list[dict[str, Any]]]:
            url = base.replace("http", "ws") + "/v1/ws"
            async with websockets.connect(url) as ws:
                await ws.recv()
                for i in range(3):
                    await ws.send(
                        orjson.dumps({"type": "completion", "id": f"w{i}", "prompt": "hi"}).decode()
                    )
                started = [orjson.loads(await ws.recv()) for _ in range(3)]
                assert [m["type"] for m in started] == ["started"] * 3  # each with its resume token
                first = [orjson.loads(await ws.recv()) for _ in range(3)]
                async with httpx.AsyncClient(base_url=base) as http:
                    full = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                pulled.extend(await asyncio.to_thread(engine.pull, 1, 5.0))  # the head of the queue leaves
                moved = [orjson.loads(await ws.recv()) for _ in range(2)]
            return first, full, moved

        first, full, moved = asyncio.run(go())
        assert sorted((m["type"], m["id"], m["position"]) for m in first) == [
            ("queued", "w0", 1),
            ("queued", "w1", 2),
            ("queued", "w2", 3),
        ]
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        assert not any(c.isdigit() for c in full.json()["error"]["message"]), full.text  # no depth
        assert sorted((m["id"], m["position"]) for m in moved) == [("w1", 1), ("w2", 2)]
        # The socket closed: after the grace time its waiting requests leave the queue.
        deadline = time.monotonic() + 10
        while asyncio.run(broker.pending()):
            assert time.monotonic() < deadline, "the detached requests stayed queued"
            time.sleep(0.05)
        assert engine.aborts() == [pulled[0].request_id]  # and the one an engine took is aborted there
    engine.close()
    broker.close()
