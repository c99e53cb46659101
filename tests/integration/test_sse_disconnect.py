"""A client that leaves mid-answer frees its engine request within one step: checked by
inspecting the engine (steps and known requests), not by timing."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import orjson


def test_closing_an_sse_stream_aborts_the_engine_request(tiny_server: Any) -> None:
    aborts = tiny_server.metric("wsllm_request_aborts_total")
    body = {
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = orjson.loads(first[6:])["id"]
        assert tiny_server.engine.is_known(rid)
    # The response is closed: the connection is gone mid-stream.
    tiny_server.assert_engine_forgot(rid)
    assert tiny_server.metric("wsllm_request_aborts_total") - aborts == 1
    tiny_server.assert_no_blocks_held()


def test_leaving_a_non_streamed_request_aborts_it(tiny_server: Any) -> None:
    body = orjson.dumps({"prompt": [4, 5, 6], "max_tokens": 2000, "ignore_eos": True})
    host, port = tiny_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        # Wait until the engine runs it, then hang up without reading the answer.
        while not tiny_server.gateway.router.request_ids():
            time.sleep(0.005)
        (rid,) = tiny_server.gateway.router.request_ids()
        tiny_server.worker.wait_steps(1)
        assert tiny_server.engine.is_known(rid)
    tiny_server.assert_engine_forgot(rid)
    tiny_server.assert_no_blocks_held()


def test_many_clients_leaving_at_once(tiny_server: Any) -> None:
    """32 streams cut after their first chunk: every engine request goes, no block leaks."""

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": [9, i + 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return str(orjson.loads(line[6:])["id"])
        raise AssertionError("no chunk")

    async def run() -> list[str]:
        async with httpx.AsyncClient(
            base_url=tiny_server.base_url, timeout=60, limits=httpx.Limits(max_connections=64)
        ) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    rids = asyncio.run(run())
    assert len(set(rids)) == 32
    for rid in rids:
        tiny_server.assert_engine_forgot(rid)
    tiny_server.assert_no_blocks_held()
