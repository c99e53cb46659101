"""Who may talk to the gateway, with a real uvicorn and no engine behind it (a heartbeat
makes the gateway think one serves): the Host allow-list against DNS rebinding, the API
key guarding the API under a root_path, and the key and resume tokens kept out of the access log."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from rawclients import connect
from websockets.exceptions import InvalidStatus

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app

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


def test_keys_and_resume_tokens_stay_out_of_the_access_log(
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
        # a resume token in the query reaches the route (a 404: this broker resumes
        # nothing; without a token it is a 400) but not the log
        auth = {"authorization": f"Bearer {KEY}"}
        resumed = httpx.get(
            f"{base}/v1/streams/cmpl-1?resume_token=cmpl-1.s3cret&last_event_id=2", headers=auth
        )
        assert resumed.status_code == 404 and resumed.json()["error"]["code"] == "unknown_id", resumed.text
        assert httpx.get(f"{base}/v1/streams/cmpl-1?last_event_id=2", headers=auth).status_code == 400
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("uvicorn"))
    assert "/v1/ws" in logged and "x=1" in logged and "last_event_id=2" in logged  # the access log is on...
    assert (
        KEY not in logged and "wrong" not in logged and "s3cret" not in logged
    )  # ...and has no secret in it
    broker.close()
