"""A Responses body and its translation (wsllm/server/api/responses/request.py, translate.py): a 400 names
the field as the client wrote it (`input.0.content.0.text`, not a union's branch), and
the conversation becomes the chat request the other routes prepare: instructions
first, a call joined to the assistant turn before it, a call's output a tool message
naming its function, `text.format` a response_format."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.config_gateway import GatewayConfig
from wsllm.server.api.responses.request import responses_request
from wsllm.server.api.responses.translate import to_chat, turns
from wsllm.server.errors import APIError

CFG = GatewayConfig()
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "message"}]}, "input.0.role"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
        ({"input": [{"type": "bogus"}]}, "input.0"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tools": [WEATHER, WEATHER]}, "tools.1.name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "temprature": 0}, "temprature"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        responses_request(body, CFG)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_conversation_becomes_the_chat_request() -> None:
    req = responses_request(
        {
            "instructions": "Be brief.",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather "},
                        {"type": "input_text", "text": "in Oslo?"},
                    ],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": "{}",
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "-3"},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 7,
        },
        CFG,
    )
    new = turns(req)
    chat = to_chat(req, new, 0, CFG)
    msgs = [m.as_template_input() for m in chat.messages]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0]["content"] == "Be brief." and msgs[1]["content"] == "Weather in Oslo?"
    assert (
        msgs[2]["content"] == "Let me look." and msgs[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    assert msgs[3] == {"role": "tool", "content": "-3", "tool_call_id": "c1", "name": "get_weather"}
    assert chat.forced_tool == "get_weather" and chat.requested_max_tokens == 7


def test_text_format_becomes_response_format_and_is_not_combined_with_a_forced_call() -> None:
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}
    req = responses_request({"input": "Weather?", "tools": [WEATHER], "text": fmt}, CFG)
    chat = to_chat(req, turns(req), 0, CFG)
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.structured == ({"json": {"type": "object"}}, "response_format.json_schema.schema")
    with pytest.raises(APIError) as e:  # at validation: before admission, before any compile
        responses_request(
            {"input": "Weather?", "tools": [WEATHER], "text": fmt, "tool_choice": "required"}, CFG
        )
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_an_output_must_answer_an_earlier_call() -> None:
    history = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    body = {"input": [{"type": "function_call_output", "call_id": "c1", "output": "1"}]}
    with pytest.raises(APIError) as e:  # it continues nothing: its validation says so, before admission
        responses_request(body, CFG)
    assert e.value.status == 400 and e.value.param == "input.0.call_id"
    req = responses_request(body | {"previous_response_id": "resp_1"}, CFG)
    assert to_chat(req, history + turns(req), 1, CFG).messages[-1].role == "tool"  # the call came before
    with pytest.raises(APIError) as e:  # the stored conversation had no such call
        to_chat(req, turns(req), 0, CFG)
    assert e.value.param == "input.0.call_id"


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "id", "status", "text"]
_item = st.dictionaries(
    st.sampled_from(_ITEM_KEYS), _json | st.sampled_from(["message", "user", "function_call"])
)
_BODY_KEYS = ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
              "previous_response_id", "store", "background", "stream", "top_logprobs", "metadata", "truncation"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(st.sampled_from(_BODY_KEYS), _json, max_size=5),
    items=st.lists(_item, max_size=4),
    as_items=st.booleans(),
)
def test_any_body_is_translated_or_refused_with_a_400(
    body: dict[str, Any], items: list[Any], as_items: bool
) -> None:
    body = {"input": "hi", "tools": [WEATHER]} | body  # mostly valid, one field off at a time
    if as_items:
        body["input"] = items
    try:
        req = responses_request(body, CFG)
        to_chat(req, turns(req), 0, CFG)
    except APIError as e:
        assert e.status == 400, e.message
