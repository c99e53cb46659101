"""Admission before bodies and sockets: a key's rpm is taken before its HTTP body is
read (a key past it is refused at once, whatever body it is sending), and at the
WebSocket handshake, which is also held to a per-tenant and a total socket cap
(`--max-sockets-per-tenant`, `--max-sockets`): a refused handshake is closed with 1013
(try again later) and the reason; /metrics is rendered once per cache time for a key
without the metrics role. No engine pulls here (a registered heartbeat only)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
import websockets

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app

KEYS = """
[tenants.tight]
keys = ["sk-tight"]
rpm = 2

[tenants.many]
keys = ["sk-many"]

[tenants.more]
keys = ["sk-more"]

[tenants.narrow]
keys = ["sk-narrow"]
models = ["another-model"]
"""


@pytest.fixture
def base(tiny_model_dir: Path, uvicorn_thread: Any, tmp_path: Path) -> Iterator[str]:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    broker = MemoryBroker()
    broker.heartbeat(EngineInfo("e1", "tiny", 2048))
    cfg = GatewayConfig(
        api_keys_file=str(keys), max_sockets_per_tenant=2, max_sockets=3, metrics_cache_s=30, frontend=False
    )
    with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), cfg) as (url, _):
        yield url
    broker.close()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_a_key_past_its_rpm_is_refused_before_its_body_is_read(base: str) -> None:
    for _ in range(2):  # the key's two requests of the minute
        assert (
            httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, headers=auth("sk-tight")).status_code == 200
        )
    # the third sends its headers, a 1 MiB body announced and never sent: refused at once
    host = urlsplit(base)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host.netloc}\r\nauthorization: Bearer sk-tight\r\n"
            "content-type: application/json\r\ncontent-length: 1048576\r\n\r\n"
        )
        s.sendall(head.encode())
        answer = ""
        while "\r\n\r\n" not in answer or len(answer.partition("\r\n\r\n")[2]) < _length(answer):
            chunk = s.recv(65536).decode(errors="replace")  # headers and body may come apart
            assert chunk, answer
            answer += chunk
    status, _, rest = answer.partition("\r\n")
    assert " 429 " in status, answer[:500]
    assert "rate_limited" in rest and "2 requests per minute" in rest, rest[-500:]


def _length(answer: str) -> int:
    head = answer.partition("\r\n\r\n")[0].lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


def test_metrics_are_rendered_once_per_cache_time_for_a_key_without_the_metrics_role(base: str) -> None:
    """A page of /metrics is the gateway's CPU (a few ms a call): a key without the metrics
    role gets its view's page from a cache of --metrics-cache-s (30 s here), however often
    it asks: the error counted between its two pages is not in the second."""
    first = httpx.get(f"{base}/metrics", headers=auth("sk-many"), timeout=30)
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": 5}, headers=auth("sk-many"), timeout=30)
    assert bad.status_code == 400
    second = httpx.get(f"{base}/metrics", headers=auth("sk-many"), timeout=30)
    assert first.status_code == second.status_code == 200 and first.text == second.text


async def _open(base: str, key: str) -> Any:
    ws = await websockets.connect(base.replace("http", "ws", 1) + "/v1/ws", additional_headers=auth(key))
    return ws


async def _refused(base: str, key: str) -> tuple[int | None, str]:
    """The close code and reason of a handshake the gateway refuses."""
    ws = await _open(base, key)
    try:
        await asyncio.wait_for(ws.recv(), 10)
    except websockets.ConnectionClosed as e:
        return e.rcvd.code if e.rcvd else None, e.rcvd.reason if e.rcvd else ""
    finally:
        await ws.close()
    raise AssertionError("the socket was accepted")


def test_a_websocket_handshake_takes_a_request_of_rpm(base: str) -> None:
    async def go() -> tuple[int | None, str]:
        first, second = await _open(base, "sk-tight"), await _open(base, "sk-tight")
        for ws in (first, second):
            assert orjson.loads(await ws.recv())["type"] == "hello"
            await ws.close()
        return await _refused(base, "sk-tight")

    code, reason = asyncio.run(go())
    assert code == 1013 and "2 requests per minute" in reason, (code, reason)


def test_sockets_are_capped_per_tenant_and_in_all(base: str) -> None:
    async def go() -> list[tuple[int | None, str]]:
        mine = [await _open(base, "sk-many") for _ in range(2)]
        for ws in mine:
            assert orjson.loads(await ws.recv())["type"] == "hello"
        out = [await _refused(base, "sk-many")]  # the tenant's third
        other = await _open(base, "sk-more")  # another tenant's first: the third in all
        assert orjson.loads(await other.recv())["type"] == "hello"
        out.append(await _refused(base, "sk-more"))  # a fourth in all
        await mine[0].close()
        deadline = time.monotonic() + 10
        while True:  # its place is free once the gateway saw it close
            again = await _open(base, "sk-many")
            try:
                if orjson.loads(await asyncio.wait_for(again.recv(), 10))["type"] == "hello":
                    break
            except websockets.ConnectionClosed:
                assert time.monotonic() < deadline, "a closed socket's place was never freed"
                await asyncio.sleep(0.1)
        for ws in (*mine, other, again):
            await ws.close()
        return out

    (tenant_cap, total_cap) = asyncio.run(go())
    assert tenant_cap[0] == 1013 and "2 WebSockets" in tenant_cap[1], tenant_cap
    assert total_cap[0] == 1013 and "3 WebSockets" in total_cap[1], total_cap


def test_the_hello_names_no_model_the_key_may_not_use(base: str) -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        narrow, wide = await _open(base, "sk-narrow"), await _open(base, "sk-many")
        hellos = orjson.loads(await narrow.recv()), orjson.loads(await wide.recv())
        await narrow.close()
        await wide.close()
        return hellos

    narrow, wide = asyncio.run(go())
    assert wide["model"] == "tiny"
    assert narrow["model"] is None, narrow
