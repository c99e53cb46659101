"""`wsllm engine --fake-step-ms`: a gateway and two fake engines (no model) on a real
redis-server serve a streamed chat completion with the fake's fixed text, and a cancel
stops the fake engine's request, as the real engine's would. The scale bench
(bench/broker_scale.py) stands on this."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets
from redis_fixtures import Cluster, ws_messages, ws_url

from wsllm.engine.fake import fake_token_ids


@pytest.fixture(scope="module")
def fakes(redis_server: Any, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    redis_server.client().flushdb()
    cluster = Cluster(redis_server.url, smollm_dir, tmp_path_factory.mktemp("fake-engines"))
    for i in (1, 2):
        cluster.start_engine(f"fake-{i}", "--fake-step-ms", "20")
    cluster.start_gateway()
    try:
        cluster.wait_ready(engines=2)
        yield cluster
    finally:
        cluster.stop()


def _expected_text(model_dir: Path, n: int) -> str:
    from tokenizers import Tokenizer

    ids = fake_token_ids(model_dir)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(
        [ids[i % len(ids)] for i in range(n)]
    )


async def _chat_stream(base: str, max_tokens: int) -> tuple[str, str | None, int]:
    """A streamed chat completion: its text, finish reason and number of content chunks."""
    text, finish, chunks = "", None, 0
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{base}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                text += choice["delta"]["content"]
                chunks += 1
            finish = choice["finish_reason"] or finish
    return text, finish, chunks


def test_fake_engines_stream_a_chat_completion(fakes: Cluster, smollm_dir: Path) -> None:
    async def run() -> list[tuple[str, str | None, int]]:
        return await asyncio.gather(*(_chat_stream(fakes.urls[0], 23) for _ in range(4)))

    want = _expected_text(smollm_dir, 23)
    for text, finish, chunks in asyncio.run(run()):
        assert (text, finish) == (want, "length")
        assert chunks > 1  # streamed token by token, not in one piece


def test_a_cancel_stops_the_fake_engines_request(fakes: Cluster) -> None:
    before = sum(s["num_aborted_total"] for s in fakes.engine_stats().values())

    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(ws_url(fakes.urls[0])) as ws:
            await ws.recv()  # hello
            msg = {
                "type": "chat",
                "id": "c",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2000,
            }
            await ws.send(orjson.dumps(msg).decode())
            first = await ws_messages(ws, lambda m: m["type"] == "delta")
            await ws.send(orjson.dumps({"type": "cancel", "id": "c"}).decode())
            return first + await ws_messages(ws, lambda m: m["type"] in ("done", "error"))

    msgs = asyncio.run(run())
    assert msgs[-1]["type"] == "done" and msgs[-1]["finish_reason"] == "abort", msgs[-1]
    assert msgs[-1]["usage"]["completion_tokens"] < 2000
    deadline = time.monotonic() + 10  # the engines' heartbeats (every 0.2 s) carry their counts

    def settled() -> bool:
        stats = fakes.engine_stats().values()
        aborted = sum(s["num_aborted_total"] for s in stats) > before
        return aborted and all(s["num_running"] == 0 for s in stats)

    while not settled():  # the engine let the request go instead of running it to 2000 tokens
        assert time.monotonic() < deadline, f"no fake engine aborted the request: {fakes.engine_stats()}"
        time.sleep(0.1)
