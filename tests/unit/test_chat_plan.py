"""A chat request's plan (wsllm/server/chat/plan.py): the tool fields' schemas (tool
messages, tool_choice), the prompt of a template that knows no tools (the real SmolLM2
template), and the constraint for tool_choice "required" or a named function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from wsllm.config_gateway import GatewayConfig
from wsllm.server.chat.plan import plan_chat
from wsllm.server.errors import APIError
from wsllm.server.schemas import ChatRequest, validate_http
from wsllm.server.text import TextCodec

CFG = GatewayConfig()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
]


def validate(body: dict[str, Any]) -> ChatRequest:
    req = validate_http(ChatRequest, orjson.dumps(body), CFG)
    assert isinstance(req, ChatRequest)
    return req


def refused(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        validate(body)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == e.value.param
    return e.value


def test_a_tool_round_trip_is_accepted() -> None:
    req = validate(
        {"messages": ROUND_TRIP, "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False}
    )
    assistant, tool = (m.as_template_input() for m in req.messages[1:])
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"
    }
    assert tool == {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"}
    assert req.offered_tools == [WEATHER] and req.forced_tool is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_get_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    e = refused({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]} | body)
    assert e.param == param, e.message
    assert e.message.startswith(param)


def test_tool_choice_none_offers_no_tools_and_named_forces_one() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME]}
    assert validate(base | {"tool_choice": "none"}).offered_tools == []
    named = validate(base | {"tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.forced_tool == "get_time"
    assert validate(base | {"tool_choice": "required"}).forced_tool == ""


def test_max_completion_tokens_is_max_tokens() -> None:
    req = validate({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7})
    assert req.requested_max_tokens == 7


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec(str(smollm_dir))


def test_a_template_without_tools_gets_them_in_the_system_message(codec: TextCodec) -> None:
    """SmolLM2's template ignores `tools`: the plan writes them, the earlier call and
    its result into the messages, in the style the parser reads."""
    req = validate({"messages": ROUND_TRIP, "tools": [WEATHER], "chat_template_kwargs": {"foo": 1}})
    plan = plan_chat(req, codec, "SmolLM2-135M-Instruct")
    assert plan.output.tool_parser == "hermes" and plan.sampling == {}
    assert plan.template["template_kwargs"] == {"foo": 1}
    ids = codec.encode_chat([m.as_template_input() for m in req.messages], **plan.template)
    prompt = codec.backend.decode(ids, skip_special_tokens=False)
    assert (
        prompt.startswith("<|im_start|>system\n") and '"name": "get_weather"' in prompt.split("<|im_end|>")[0]
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": -3}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_no_tools_no_plan(codec: TextCodec) -> None:
    plan = plan_chat(validate({"messages": [{"role": "user", "content": "hi"}]}), codec, "m")
    assert plan.template == {} and plan.output.tool_parser is None and plan.sampling == {}


def test_required_and_named_come_with_a_structured_constraint(codec: TextCodec) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME]}
    required = plan_chat(validate(base | {"tool_choice": "required"}), codec, "m")
    assert "grammar" in required.sampling["structured"]
    named = plan_chat(
        validate(base | {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}), codec, "m"
    )
    assert '"const": "get_time"' in named.sampling["structured"]["grammar"]
    assert "get_weather" not in named.sampling["structured"]["grammar"]


def test_a_style_that_writes_values_bare_gets_their_types(codec: TextCodec) -> None:
    """qwen3_coder reads a value by its parameter's type: the plan keeps the types with
    the output options (and so in the resume context), and the earlier call is written
    in its style."""
    req = validate({"messages": ROUND_TRIP, "tools": [WEATHER, TIME]})
    plan = plan_chat(req, codec, "m", tool_parser="qwen3_coder")
    assert plan.output.tool_parser == "qwen3_coder"
    assert plan.output.arg_types == {"get_weather": {"city": ["string"], "unit": ["string"]}, "get_time": {}}
    ids = codec.encode_chat([m.as_template_input() for m in req.messages], **plan.template)
    prompt = codec.backend.decode(ids, skip_special_tokens=False)
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>" in prompt
