"""The Messages API's rendering of answers a random model never writes, through the
official `anthropic` client: the engine side is driven by hand (a thread that answers
each request with scripted tokens), so a `<think>` block, and a failure midway, are
exactly what the gateway gets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app
from wsllm.server.text import TextCodec
from wsllm.types import TokenEvent, Usage

THOUGHT_AND_ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello there, friend."
FAILS = "[fail]"  # a prompt containing this fails after one token


class ScriptedEngine:
    """Answers every request with the tokens of `THOUGHT_AND_ANSWER`, a few per event;
    a prompt with FAILS gets one token, then a failure."""

    def __init__(self, broker: MemoryBroker, codec: TextCodec) -> None:
        self.broker, self.codec = broker, codec
        self.ids = codec.encode(THOUGHT_AND_ANSWER)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for req in self.broker.pull(4, 0.05):
                self._answer(req)

    def _answer(self, req: Any) -> None:
        rid = req.request_id
        if FAILS in self.codec.backend.decode(req.prompt_token_ids):
            self.broker.publish([TokenEvent(rid, 0, self.ids[:1])])
            self.broker.publish([TokenEvent.failure(rid, "internal_error", "the engine broke", 1)])
            return
        chunks = [self.ids[i : i + 3] for i in range(0, len(self.ids), 3)]
        usage = Usage(len(req.prompt_token_ids), len(self.ids), 0)
        events = [TokenEvent(rid, seq, ids) for seq, ids in enumerate(chunks)]
        events[-1].finish_reason, events[-1].usage = "stop", usage
        for e in events:
            self.broker.publish([e])


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path, uvicorn_thread: Any) -> Iterator[str]:
    broker = MemoryBroker()
    broker.heartbeat(EngineInfo("e1", "tiny", 2048))
    engine = ScriptedEngine(broker, TextCodec(str(tiny_model_dir)))
    engine.thread.start()
    try:
        with uvicorn_thread(lambda c: create_app(c, broker, tiny_model_dir, "tiny"), GatewayConfig()) as (
            url,
            _,
        ):
            yield url
    finally:
        engine.stop.set()
        engine.thread.join(5)
        broker.close()


def _client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)


def test_the_think_block_is_a_thinking_block_streamed_and_not(base: str) -> None:
    kw: dict[str, Any] = dict(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hi"}])
    msg = _client(base).messages.create(**kw)
    want = [
        {"type": "thinking", "thinking": "The user greets me.\n", "signature": ""},
        {"type": "text", "text": "Hello there, friend."},
    ]
    assert [b.model_dump(exclude_none=True) for b in msg.content] == want
    assert msg.stop_reason == "end_turn"
    with _client(base).messages.stream(**kw) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == want
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and deltas.index("text_delta") > deltas.index("thinking_delta")
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]


def test_a_failure_midway_is_an_error_event_the_client_raises(base: str) -> None:
    kw: dict[str, Any] = dict(model="tiny", max_tokens=64, messages=[{"role": "user", "content": FAILS}])
    with pytest.raises(anthropic.APIStatusError) as e, _client(base).messages.stream(**kw) as stream:
        list(stream)
    assert "the engine broke" in str(e.value)
    with pytest.raises(anthropic.InternalServerError) as plain:
        _client(base).messages.create(**kw)
    body = plain.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "api_error"
