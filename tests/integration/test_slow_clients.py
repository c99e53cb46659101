"""No client can hurt another (issue 12), on the in-process deployment: a bad value
costs its own request only, a client that stops reading is cut off after
--send-timeout-s with its KV blocks freed and the gateway's buffers bounded meanwhile,
and the per-socket and per-request caps hold."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets
from rawclients import sse_post, ws_connect, ws_send

# A stalled reader is cut off by whichever comes first: --send-timeout-s without a byte
# taken, or --max-buffered-events piling up behind it. The tiny engine makes ~1000 events
# a second at n=8, so this buffer takes ~4 s to fill: the send timeout is what fires.
LIMITS = dict(
    send_timeout_s=0.5,
    max_buffered_events=4096,
    max_requests_per_socket=3,
    max_messages=64,
    heartbeat_s=60.0,  # the WebSocket pings must not be what drops the silent clients here
)


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **LIMITS) as s:
        yield s


def body(prompt: list[int], n_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True} | kw


async def stream_text(http: httpx.AsyncClient, b: dict[str, Any]) -> tuple[str, str | None]:
    text, finish = "", None
    async with http.stream("POST", "/v1/completions", json=b | {"stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
    return text, finish


def test_a_huge_top_k_is_a_400_and_the_streams_beside_it_go_on(srv: Any) -> None:
    """The issue's reproduction: two streams run when a request with top_k = 2**64 - 1
    comes. It is refused, naming the field; the two finish as they would alone."""
    goods = [body([11, 12, 13], 80), body([21, 22], 80, temperature=0.7, seed=5)]

    async def go() -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]], httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as http:
            alone = [await stream_text(http, b) for b in goods]
            running = [asyncio.create_task(stream_text(http, b)) for b in goods]
            await asyncio.sleep(0.2)
            bad = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "top_k": 18446744073709551615},
            )
            return alone, list(await asyncio.gather(*running)), bad

    alone, together, bad = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
    assert together == alone and all(f == "length" for _, f in together)


def test_a_tiny_temperature_is_greedy(srv: Any) -> None:
    greedy = httpx.post(f"{srv.base_url}/v1/completions", json=body([5, 6, 7], 12), timeout=60)
    tiny = httpx.post(
        f"{srv.base_url}/v1/completions", json=body([5, 6, 7], 12, temperature=1e-300), timeout=60
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


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
                    orjson.dumps({"type": "completion", "id": f"q{i}"} | body([3, i], 2000)).decode()
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


def _wait_metric(srv: Any, name: str, at_least: float, timeout: float = 30.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while (value := srv.metric(name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {value}"
        time.sleep(0.1)
    return value


def _watch_until_forgotten(srv: Any, n: int, timeout: float = 60.0) -> int:
    """Once the gateway follows `n` requests: until it follows none; returns the most
    events it buffered meanwhile."""
    most = 0
    deadline = time.monotonic() + timeout
    while len(srv.gateway.router.request_ids()) < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    while srv.gateway.router.request_ids():
        most = max(most, srv.gateway.router.buffered_events())
        assert time.monotonic() < deadline, f"the gateway still follows {srv.gateway.router.request_ids()}"
        time.sleep(0.01)
    return most


def test_a_websocket_client_that_never_reads_is_dropped_and_its_requests_freed(srv: Any) -> None:
    timeouts = srv.metric("wsllm_send_timeouts_total", transport="ws")
    sock = ws_connect(srv.base_url)
    try:
        for i in range(3):  # 3 x 8 choices x 2000 tokens with logprobs: far more than any buffer
            ws_send(sock, {"type": "completion", "id": f"s{i}"} | body([7, i], 2000, n=8, logprobs=20))
        most = _watch_until_forgotten(srv, 3)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    assert most <= 3 * LIMITS["max_buffered_events"]  # type: ignore[operator]
    # the client is dropped once it has taken nothing for --send-timeout-s
    assert _wait_metric(srv, "wsllm_send_timeouts_total", timeouts + 1, transport="ws") == timeouts + 1
    srv.assert_no_blocks_held()


def test_an_sse_client_that_never_reads_is_dropped_and_its_request_freed(srv: Any) -> None:
    timeouts = srv.metric("wsllm_send_timeouts_total", transport="sse")
    sock = sse_post(srv.base_url, "/v1/completions", body([9, 9], 2000, n=8, logprobs=20))
    try:
        most = _watch_until_forgotten(srv, 1)
    finally:
        sock.close()
    assert most <= LIMITS["max_buffered_events"]  # type: ignore[operator]
    assert _wait_metric(srv, "wsllm_send_timeouts_total", timeouts + 1, transport="sse") == timeouts + 1
    srv.assert_no_blocks_held()
