"""gpt-oss's harmony answers through the official openai and anthropic clients: a tiny
model directory whose tokenizer has the harmony markers as special tokens and a chat
template of gpt-oss's shape (tests/conftest.py: tiny_harmony_dir), its engine driven by hand
(a thread that answers with scripted harmony tokens: a random model writes no channels).
The analysis channel comes back as `reasoning_content` and thinking blocks, a commentary
call as a tool call with valid JSON arguments, the final channel as the text, streamed and
whole alike; a broken answer is text with a 200, never a 500."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from wsllm.broker.base import EngineInfo
from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.app import create_app
from wsllm.server.text import TextCodec
from wsllm.types import TokenEvent, Usage

# what the scripted engine answers, by a word of the prompt
SCRIPTS = {
    "weather": "<|channel|>analysis<|message|>The user wants Oslo's weather: call get_weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    '"Oslo", "unit": "C"}<|call|>',
    "hello": "<|channel|>analysis<|message|>A greeting. Greet back.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello there, friend.<|return|>",
    "broken": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Oslo}<|call|>",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]


class ScriptedEngine:
    """Answers each request with the tokens of the script its prompt names, 2 per event."""

    def __init__(self, broker: MemoryBroker, codec: TextCodec) -> None:
        self.broker, self.codec = broker, codec
        self.prompts: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.broker.heartbeat(EngineInfo("e1", "tiny", 2048))  # alive however slow the machine
            for req in self.broker.pull(4, 0.05):
                self._answer(req)

    def _answer(self, req: Any) -> None:
        prompt = self.codec.backend.decode(req.prompt_token_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        last_user = prompt.rsplit("<|start|>user<|message|>", 1)[-1]
        ids = self.codec.encode(next(s for k, s in SCRIPTS.items() if k in last_user.lower()))
        events = [
            TokenEvent(req.request_id, seq, ids[i : i + 2]) for seq, i in enumerate(range(0, len(ids), 2))
        ]
        events[-1].finish_reason = "stop"
        events[-1].usage = Usage(len(req.prompt_token_ids), len(ids), 0)
        for e in events:
            self.broker.publish([e])


@pytest.fixture(scope="module")
def served(tiny_harmony_dir: Path, uvicorn_thread: Any) -> Iterator[tuple[str, ScriptedEngine]]:
    broker = MemoryBroker()
    engine = ScriptedEngine(broker, TextCodec(str(tiny_harmony_dir)))
    engine.thread.start()
    app = lambda c: create_app(c, broker, tiny_harmony_dir, "tiny")  # noqa: E731
    try:
        with uvicorn_thread(app, GatewayConfig()) as (url, _):
            yield url, engine
    finally:
        engine.stop.set()
        engine.thread.join(5)
        broker.close()


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _streamed(url: str, **kw: Any) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """(reasoning, content, tool calls assembled as the SDK's users do, finish reason)."""
    reasoning = content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in _openai(url).chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] = (d.function and d.function.name) or c["name"]
                c["arguments"] += (d.function and d.function.arguments) or ""
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_a_call_and_its_reasoning_streamed_and_whole(served: tuple[str, ScriptedEngine]) -> None:
    url, engine = served
    kw: dict[str, Any] = dict(
        model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS
    )
    whole = _openai(url).chat.completions.create(**kw).choices[0]
    assert "namespace functions" in engine.prompts[-1], "the template wrote the tools"
    assert whole.finish_reason == "tool_calls"
    assert (whole.message.model_extra or {}).get("reasoning_content") == (
        "The user wants Oslo's weather: call get_weather."
    )
    assert not whole.message.content
    (call,) = whole.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo",
        "unit": "C",
    }
    reasoning, content, calls, finish = _streamed(url, **kw)
    assert (
        reasoning == whole.message.model_extra["reasoning_content"] and not content and finish == "tool_calls"
    )
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    assert calls[0]["id"].startswith("call_")  # each request its own ids


def test_the_final_channel_is_the_answer_without_tools(served: tuple[str, ScriptedEngine]) -> None:
    url, _ = served
    kw: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "Hello!"}])
    whole = _openai(url).chat.completions.create(**kw).choices[0]
    assert whole.message.content == "Hello there, friend." and whole.finish_reason == "stop"
    assert whole.message.model_extra["reasoning_content"] == "A greeting. Greet back."
    assert _streamed(url, **kw) == ("A greeting. Greet back.", "Hello there, friend.", [], "stop")


def test_a_broken_call_is_text(served: tuple[str, ScriptedEngine]) -> None:
    url, _ = served
    kw: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "broken"}], tools=TOOLS)
    whole = _openai(url).chat.completions.create(**kw).choices[0]
    assert whole.message.content == "{city: Oslo}" and not whole.message.tool_calls
    assert whole.finish_reason == "stop"
    assert _streamed(url, **kw)[1:] == ("{city: Oslo}", [], "stop")


def test_the_anthropic_client_gets_thinking_blocks_and_tool_use(served: tuple[str, ScriptedEngine]) -> None:
    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "Hello!"}])
    want = [
        {"type": "thinking", "thinking": "A greeting. Greet back.", "signature": ""},
        {"type": "text", "text": "Hello there, friend."},
    ]
    assert [b.model_dump(exclude_none=True) for b in client.messages.create(**kw).content] == want
    with client.messages.stream(**kw) as stream:
        starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
        assert [b.model_dump(exclude_none=True) for b in stream.get_final_message().content] == want
    assert starts == ["thinking", "text"]
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    kw |= {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools}
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[1].name == "get_weather" and msg.content[1].input == {"city": "Oslo", "unit": "C"}
