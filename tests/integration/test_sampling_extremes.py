"""Sampling values at the edge of what the wire holds, on the in-process deployment: a
value past its bound costs its own request only (a 400 naming the field, the streams
beside it untouched), and a temperature too small to divide by is greedy."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from bodies import completion


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


def test_a_huge_top_k_is_a_400_and_the_streams_beside_it_go_on(tiny_server: Any) -> None:
    """The issue's reproduction: two streams run when a request with top_k = 2**64 - 1
    comes. It is refused, naming the field; the two finish as they would alone."""
    goods = [completion([11, 12, 13], 80), completion([21, 22], 80, temperature=0.7, seed=5)]

    async def go() -> tuple[list[tuple[str, str | None]], list[tuple[str, str | None]], httpx.Response]:
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as http:
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


def test_a_tiny_temperature_is_greedy(tiny_server: Any) -> None:
    greedy = httpx.post(f"{tiny_server.base_url}/v1/completions", json=completion([5, 6, 7], 12), timeout=60)
    tiny = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        json=completion([5, 6, 7], 12, temperature=1e-300),
        timeout=60,
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
