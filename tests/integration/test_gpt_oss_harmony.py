"""gpt-oss's harmony end to end on a gpt-oss model: the tiny random-weight GptOss whose tokenizer
has harmony's markers as special tokens (tests/conftest.py: tiny_gpt_oss_harmony) in a real engine
behind the real app. A random model writes no channels of itself, so the constraint writes them:
a forced call (`tool_choice: "required"`, harmony's grammar over its special tokens) whose
arguments the model picks within their schema, and a grammar (`structured_outputs`) naming a whole
answer (reasoning, then the final text; a call whose body is no JSON). Through the official openai
client, streamed and whole alike: `reasoning_content`, the call with valid JSON arguments, the
final text, a broken call as text with a 200; and the anthropic client's thinking blocks: the
model's own analysis message before a forced call (the Messages API has no grammar field), the same
text as the chat's `reasoning_content` for the same request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import orjson
import pytest

from wsllm.config import EngineConfig
from wsllm.server.chat.output import assemble_tool_calls
from wsllm.server.chat.style import lark_literal

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,  # else a random model writes more until max_tokens
        },
    },
}
THOUGHT, ANSWER = "A greeting. Greet back.", "Hello there, friend."


def script(*pieces: str) -> dict[str, Any]:
    """The grammar of exactly this answer: markers (`<|...|>`) as harmony's special tokens, the
    rest as text."""
    parts = [p if p.startswith("<|") else lark_literal(p) for p in pieces]
    return {"structured_outputs": {"grammar": "start: " + " ".join(parts) + "\n"}}


HELLO = script(
    "<|channel|>",
    "analysis",
    "<|message|>",
    THOUGHT,
    "<|end|>",
    "<|start|>",
    "assistant",
    "<|channel|>",
    "final",
    "<|message|>",
    ANSWER,
)
BROKEN = script(
    "<|channel|>", "commentary to=functions.lookup ", "<|constrain|>", "json", "<|message|>", "{city: Oslo}"
)


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_gpt_oss_harmony: Path) -> Iterator[Any]:
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_gpt_oss_harmony), num_kv_blocks=256, max_num_seqs=8, dtype="float32")
    )
    with live_server(engine) as s:
        yield s


def _client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def _streamed(srv: Any, **kw: Any) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """(reasoning, content, tool calls assembled as the SDK's users do, finish reason)."""
    reasoning, content, deltas, finish = [], [], [], None
    for chunk in _client(srv).chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(ch.delta.content or "")
            deltas += [tc.model_dump(exclude_none=True) for tc in ch.delta.tool_calls or []]
            finish = ch.finish_reason or finish
    return "".join(reasoning), "".join(content), assemble_tool_calls(deltas), finish


def test_reasoning_then_the_final_text_streamed_and_whole(srv: Any) -> None:
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=64,
        temperature=0,
        extra_body=HELLO,
    )
    whole = _client(srv).chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop", whole
    assert whole.message.content == ANSWER
    assert (whole.message.model_extra or {}).get("reasoning_content") == THOUGHT
    assert _streamed(srv, **kw) == (THOUGHT, ANSWER, [], "stop")


def test_a_forced_call_has_valid_json_arguments_streamed_and_whole(srv: Any) -> None:
    """The grammar makes the call; the model picks its arguments (an analysis message first,
    if it takes one, is kept short by a bias on `<|end|>`)."""
    end = srv.gateway.codec.hf.convert_tokens_to_ids("<|end|>")
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        tools=[LOOKUP],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        logit_bias={str(end): 100},
    )
    whole = _client(srv).chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls or []
    assert call.function.name == "lookup" and call.id.startswith("call_")
    jsonschema.validate(orjson.loads(call.function.arguments), LOOKUP["function"]["parameters"])
    assert not whole.message.content
    reasoning, content, calls, finish = _streamed(srv, **kw)
    assert finish == "tool_calls" and not content
    assert reasoning == ((whole.message.model_extra or {}).get("reasoning_content") or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("lookup", call.function.arguments)
    ]


def test_a_broken_call_is_text_never_a_500(srv: Any) -> None:
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        messages=[{"role": "user", "content": "broken"}],
        tools=[LOOKUP],
        max_tokens=64,
        temperature=0,
        extra_body=BROKEN,
    )
    whole = _client(srv).chat.completions.create(**kw).choices[0]
    assert whole.message.content == "{city: Oslo}" and not whole.message.tool_calls
    assert whole.finish_reason == "stop"
    assert _streamed(srv, **kw)[1:] == ("{city: Oslo}", [], "stop")


def test_the_anthropic_client_gets_the_models_analysis_as_thinking_blocks(srv: Any) -> None:
    """A forced call asked of both APIs, greedy: the model's own analysis message (it writes
    one here, on to max_tokens) is the Messages API's thinking block, as it is the chat's
    `reasoning_content`; a call it makes is a tool_use with the chat's arguments; streamed as
    whole."""
    ask = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
    chat = _client(srv).chat.completions.create(
        model=srv.gateway.model_name,
        messages=ask,
        tools=[LOOKUP],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=48,
        temperature=0,
    )
    choice = chat.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        max_tokens=48,
        messages=ask,
        tools=[{"name": "lookup", "input_schema": LOOKUP["function"]["parameters"]}],
        tool_choice={"type": "tool", "name": "lookup"},
        extra_body={"temperature": 0},  # greedy (this SDK's create takes no temperature)
    )
    msg = client.messages.create(**kw)
    thinking = [b.thinking for b in msg.content if b.type == "thinking"]
    assert thinking == ([reasoning] if reasoning else []) and reasoning, (msg, choice)
    calls = [(c.function.name, orjson.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == calls
    stops = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
    assert msg.stop_reason == stops[choice.finish_reason]
    with client.messages.stream(**kw) as stream:
        starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
        final = stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        b.model_dump(exclude_none=True) for b in msg.content
    ]
    assert starts == [b.type for b in msg.content]
