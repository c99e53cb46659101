"""The gateway's edges, with a real uvicorn and no engine behind it (a heartbeat makes
the gateway think one serves): the Host allow-list, the API key under a root_path and
out of the access log, the event reader's supervision and /health, and a Redis outage
during a WebSocket cancel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets
from rawclients import connect
from websockets.exceptions import InvalidStatus

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.broker.redis import RedisBroker
from wsllm.config import GatewayConfig, RedisConfig
from wsllm.server.app import create_app
from wsllm.types import TokenEvent

KEY = "edge-key"


def registered(broker: Any, model: str) -> Any:
    broker.heartbeat(EngineInfo("e1", model, 2048))
    return broker


async def ws_status(url: str, **kw: Any) -> int:
    try:
        async with websockets.connect(url, **kw) as ws:
            await ws.recv()
            return 101
    except InvalidStatus as e:
        return int(e.response.status_code)


def test_a_foreign_host_name_is_refused(tiny_model_dir: Path, uvicorn_thread: Any) -> None:
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 sends
    Host and Origin evil.example, which pass a same-origin check; the Host list stops it."""
    broker = registered(MemoryBroker(), "tiny")
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), GatewayConfig()) as (
        base,
        _,
    ):
        port = base.rsplit(":", 1)[1]
        evil = {"host": f"evil.example:{port}"}
        r = httpx.get(f"{base}/v1/models", headers=evil)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert httpx.get(f"{base}/", headers=evil).status_code == 400
        ws = base.replace("http", "ws") + "/v1/ws"
        sock = connect(base)
        sock.sendall(
            f"GET /v1/ws HTTP/1.1\r\nHost: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 403"), "the WebSocket of a foreign Host name opened"
        sock.close()
        # the names of this machine still work
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert httpx.get(f"{base}/v1/models", headers={"host": host}).status_code == 200, host
        assert asyncio.run(ws_status(ws)) == 101
    broker.close()


def test_the_api_key_guards_the_api_under_a_root_path(tiny_model_dir: Path, uvicorn_thread: Any) -> None:
    broker = registered(MemoryBroker(), "tiny")
    cfg = GatewayConfig(api_key=KEY)
    app_for = lambda c: create_app(c, broker, tiny_model_dir, "tiny")  # noqa: E731
    # Behind a proxy that strips /api: requests come as /v1/..., the app sees /api/v1/...
    with uvicorn_thread(app_for, cfg, root_path="/api") as (base, _):
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{base}/metrics").status_code == 401
        ok = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{base}/health").status_code == 200
    broker.close()


def test_the_websocket_key_stays_out_of_the_access_log(
    tiny_model_dir: Path, uvicorn_thread: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker = registered(MemoryBroker(), "tiny")
    cfg = GatewayConfig(api_key=KEY)
    app_for = lambda c: create_app(c, broker, tiny_model_dir, "tiny")  # noqa: E731
    with (
        caplog.at_level(logging.INFO),
        uvicorn_thread(app_for, cfg, log_level="info", log_config=None, access_log=True) as (base, _),
    ):
        ws = base.replace("http", "ws") + f"/v1/ws?api_key={KEY}&x=1"
        assert asyncio.run(ws_status(ws)) == 101
        assert asyncio.run(ws_status(base.replace("http", "ws") + "/v1/ws?api_key=wrong")) == 403
        httpx.get(f"{base}/v1/models?api_key={KEY}")
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("uvicorn"))
    assert "/v1/ws" in logged and "x=1" in logged  # the access log is on...
    assert KEY not in logged and "wrong" not in logged  # ...and has no key in it
    broker.close()


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
