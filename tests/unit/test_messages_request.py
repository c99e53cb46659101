"""Anthropic's Messages request as the chat request it means (no model needed): tool_use
and tool_result blocks become calls and tool messages in order, thinking sent back is
not shown to the model, a 400 of the chat request names the Messages field; the content
block events of a streamed answer; the stop string that ended a text is named."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from wsllm.config_gateway import GatewayConfig
from wsllm.server.api.messages.render import BlockStream
from wsllm.server.api.messages.request import CountTokensRequest, MessagesRequest, parsed
from wsllm.server.api.messages.translate import to_chat
from wsllm.server.delta import Delta
from wsllm.server.errors import APIError
from wsllm.server.schemas import ChatRequest
from wsllm.server.text import StopMatcher

CFG = GatewayConfig()
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def validate_body(raw: bytes, cfg: GatewayConfig, model: type[CountTokensRequest]) -> ChatRequest:
    """What the route's validation makes of a body: its shape checked, then translated."""
    return to_chat(parsed(raw, cfg, model), cfg)


def _chat(**body: Any) -> Any:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return validate_body(orjson.dumps(base | body), CFG, MessagesRequest)


def test_a_tool_round_trip_becomes_calls_and_tool_messages_in_order() -> None:
    req = _chat(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        tools=[TOOL],
        messages=[
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "-3 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    got = [m.as_template_input() for m in req.messages]
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert got[0]["content"] == "Be brief.\n\nUse tools."
    assert got[2]["content"] == "Checking."  # the thinking it sent back is not shown
    assert [c["function"]["arguments"] for c in got[2]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert (got[3]["tool_call_id"], got[3]["name"], got[3]["content"]) == ("t1", "get_weather", "-3 C")
    assert got[4]["content"] == "Error: down"  # the model is told the call failed
    assert req.offered_tools[0]["function"]["parameters"] == TOOL["input_schema"]


@pytest.mark.parametrize(
    ("choice", "forced", "parallel"),
    [
        ({"type": "auto"}, None, None),
        ({"type": "any", "disable_parallel_tool_use": True}, "", False),
        ({"type": "tool", "name": "get_weather"}, "get_weather", None),
        ({"type": "none"}, None, None),
    ],
)
def test_tool_choice_maps_to_the_chat_choice(
    choice: dict[str, Any], forced: str | None, parallel: bool | None
) -> None:
    req = _chat(tools=[TOOL], tool_choice=choice)
    assert (req.forced_tool, req.parallel_tool_calls) == (forced, parallel)
    assert bool(req.offered_tools) == (choice["type"] != "none")


def test_sampling_fields_and_thinking_carry_over() -> None:
    req = _chat(
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        metadata={"user_id": "u1"},
        thinking={"type": "disabled"},
        stream=True,
    )
    assert (req.stops, req.temperature, req.top_p, req.top_k, req.user) == (["END"], 0.5, 0.9, 5, "u1")
    assert req.stream and req.requested_max_tokens == 8
    assert req.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"stop_sequences": ["x"] * 99}, "stop_sequences"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi,"}]},
            "messages.1.role",
        ),
    ],
)
def test_a_bad_field_is_a_400_naming_the_messages_field(body: dict[str, Any], param: str) -> None:
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]} | body
    with pytest.raises(APIError) as e:
        validate_body(orjson.dumps({k: v for k, v in base.items() if v is not None}), CFG, MessagesRequest)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_count_tokens_takes_no_max_tokens() -> None:
    req = validate_body(
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), CFG, CountTokensRequest
    )
    assert req.requested_max_tokens is None


def _events(frames: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(f.split(b"data: ", 1)[1]) for f in frames]


def test_block_events_open_a_block_per_kind_and_per_call() -> None:
    s = BlockStream()
    call = [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
    frames = s.feed(Delta(0, "", reasoning="hm")) + s.feed(Delta(0, "Hi", reasoning=" ok"))
    frames += s.feed(Delta(0, " there", tool_calls=call)) + s.close()
    got = [
        (e["type"], e.get("index"), e.get("content_block", e.get("delta", {})).get("type"))
        for e in _events(frames)
    ]
    assert got == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]
    assert _events(frames)[8]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}


def test_the_stop_string_that_ended_the_text_is_named() -> None:
    m = StopMatcher(["lo wor", "wo", "x"])
    assert m.feed("hel") == ("he", False) and m.matched is None
    # "wo" is complete, but "lo wor" starts earlier and could still complete: it wins
    assert m.feed("lo wo") == ("l", False) and m.matched is None
    assert m.feed("rld") == ("", True) and m.matched == "lo wor"
    tail = StopMatcher(["abc", "b"])
    assert tail.feed("ab") == ("", False)
    assert tail.flush() == ("a", True) and tail.matched == "b"
