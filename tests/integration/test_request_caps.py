"""The per-request and per-socket caps, on the in-process deployment: a chat of more
messages than --max-messages is refused by count however small each is, and a resume
takes one of the socket's --max-requests-per-socket places as a new request does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets
from bodies import completion

CAPS = dict(max_requests_per_socket=3, max_messages=64)


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **CAPS) as s:
        yield s


def test_a_body_of_many_tiny_messages_is_refused_by_count(srv: Any) -> None:
    many = {"messages": [{"role": "user", "content": ""}] * 36000}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=many, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "at most 64 messages" in r.json()["error"]["message"]
    ok = httpx.post(
        f"{srv.base_url}/v1/chat/completions", json={"messages": many["messages"][:64], "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_a_resume_counts_against_the_sockets_request_cap(srv: Any) -> None:
    async def go() -> dict[str, Any]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.recv()
            for i in range(3):
                await ws.send(
                    orjson.dumps({"type": "completion", "id": f"q{i}"} | completion([3, i], 2000)).decode()
                )
            await ws.send(
                orjson.dumps({"type": "resume", "id": "r", "after_seq": -1, "resume_token": "x.y"}).decode()
            )
            while (m := orjson.loads(await ws.recv()))["type"] != "error":
                pass
            return m

    m = asyncio.run(go())
    assert (m["id"], m["code"]) == ("r", "too_many_requests")
    srv.wait_gateway_forgot()
    srv.assert_no_blocks_held()
