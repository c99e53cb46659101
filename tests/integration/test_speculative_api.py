"""Speculative decoding through the gateway: a server that drafts streams the same text as one
that does not, over SSE (the official client) and the WebSocket, several tokens to an event;
usage says how many drafts were accepted and rejected, /metrics counts them, and `wsllm bench`
reports them per level."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import websockets

from wsllm.config import EngineConfig
from wsllm.loadgen import BenchConfig
from wsllm.loadgen.runner import main

PROMPT = "Repeat after me: one two three, one two three, one two three, one two three"
BODY: dict[str, Any] = {"max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def servers(live_server: Any, tiny_gguf_path: Path) -> Iterator[dict[str, Any]]:
    from wsllm.engine.engine import LLMEngine

    def engine(**kw: Any) -> Any:
        return LLMEngine.from_config(
            EngineConfig(model=str(tiny_gguf_path), dtype="float32", kv_cache_gb=0.05, **kw)
        )

    with (
        live_server(engine()) as plain,
        live_server(engine(speculative="ngram", speculative_adaptive=False)) as fast,
    ):
        yield {"plain": plain, "fast": fast}


def stream(srv: Any) -> tuple[str, int, dict[str, Any]]:
    """The streamed text, how many chunks carried it, and the usage."""
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    chunks = client.chat.completions.create(
        model=srv.gateway.model_name,
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        stream_options={"include_usage": True},
        **BODY,
    )
    text, n, usage = "", 0, None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            text += c.choices[0].delta.content
            n += 1
        usage = c.usage or usage
    assert usage is not None
    return text, n, usage.model_dump()


def over_ws(srv: Any) -> tuple[str, dict[str, Any]]:
    async def run() -> tuple[str, dict[str, Any]]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.recv()  # hello
            msg = {"type": "chat", "id": "a", "messages": [{"role": "user", "content": PROMPT}]}
            await ws.send(
                orjson.dumps(msg | {"max_tokens": 48, "temperature": 0, "ignore_eos": True}).decode()
            )
            text = ""
            while True:
                m = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
                if m["type"] == "delta":
                    text += m["text"]
                elif m["type"] == "done":
                    return text, m["usage"]
                elif m["type"] == "error":
                    raise AssertionError(m)

    return asyncio.run(run())


def test_the_same_text_streamed_with_drafts_accepted_and_counted(servers: dict[str, Any]) -> None:
    plain_text, plain_chunks, plain_usage = stream(servers["plain"])
    text, chunks, usage = stream(servers["fast"])
    assert text == plain_text and usage["completion_tokens"] == plain_usage["completion_tokens"] == 48
    assert chunks < plain_chunks, "several tokens arrive in one event"
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    assert "completion_tokens_details" not in plain_usage or not plain_usage["completion_tokens_details"]

    ws_text, ws_usage = over_ws(servers["fast"])
    assert ws_text and ws_text == over_ws(servers["plain"])[0]
    assert ws_usage["accepted_prediction_tokens"] > 0

    fast = servers["fast"]
    deadline = time.time() + 10
    while time.time() < deadline and fast.metric("wsllm_spec_verifications") <= 0:
        time.sleep(0.2)  # gauges follow the engine's heartbeat
    drafted, accepted = fast.metric("wsllm_spec_draft_tokens"), fast.metric("wsllm_spec_accepted_tokens")
    assert (
        drafted >= accepted >= details["accepted_prediction_tokens"] + ws_usage["accepted_prediction_tokens"]
    )
    assert servers["plain"].metric("wsllm_spec_draft_tokens") == 0
    fast.assert_no_blocks_held()


def test_wsllm_bench_says_what_was_drafted(servers: dict[str, Any], tmp_path: Path) -> None:
    def level(srv: Any) -> dict[str, Any]:
        cfg = BenchConfig(
            base_url=srv.base_url, endpoint="chat", num_requests=2, concurrency="1", output_len=24,
            ignore_eos=True, json=str(tmp_path / "out.json"),
        )  # fmt: skip
        assert main(cfg) == 0
        return dict(orjson.loads((tmp_path / "out.json").read_bytes())["runs"][0])

    spec = level(servers["fast"])["speculation"]
    assert spec["drafted"] >= spec["accepted"] > 0 and spec["verifications"] > 0
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted"] / spec["verifications"])
    assert level(servers["plain"])["speculation"] is None
