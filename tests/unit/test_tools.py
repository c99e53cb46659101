"""Tool calling, request side: the schemas (tool messages, tool_choice), the parser
chosen per model, the prompt of a template that knows no tools (the real SmolLM2
template), and the constraint for tool_choice "required" or a named function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from wsllm.config import GatewayConfig
from wsllm.server.errors import APIError
from wsllm.server.schemas import ChatRequest, validate_http
from wsllm.server.text import TextCodec
from wsllm.server.tool_parsers import parse_tool_calls
from wsllm.server.tools import ToolFormat, call_schema, choose_parser, plan_chat, tool_structured

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


@pytest.mark.parametrize(
    ("template", "name", "parser"),
    [
        ("{%- if tools %}<tools>{% endif %}<tool_call>", "Qwen2.5-7B-Instruct", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}...[TOOL_CALLS]", "whatever", "mistral"),
        ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "meta", "llama3_json"),
        ("", "mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
        ("", "meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
        ("<|im_start|>", "SmolLM2-135M-Instruct", "hermes"),
    ],
)
def test_parser_per_model(template: str, name: str, parser: str) -> None:
    assert choose_parser("auto", template, name) == parser
    assert choose_parser("mistral", template, name) == "mistral"  # the flag wins


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_calls_written_into_a_prompt_read_back_as_the_same_calls(parser: str) -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    parsed = parse_tool_calls(parser, ToolFormat(parser).render_calls(calls))
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


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


def test_call_schema_accepts_what_the_parser_reads_and_nothing_else() -> None:
    tools = [WEATHER, TIME]
    schema = call_schema(tools, "hermes")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for bad in (
        {"name": "get_weather", "arguments": {}},
        {"name": "other", "arguments": {}},
        {"name": "get_time"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    llama = call_schema(tools, "llama3_json", only="get_time")
    jsonschema.validate({"name": "get_time", "parameters": {}}, llama)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"city": "x"}}, llama)


# Outputs each style's constraint must allow, read back by that style's parser. The
# grammars inside Lark write compact JSON (a model must not pad a call with whitespace).
FORCED_OUTPUTS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}; {"name":"get_time","parameters":{}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_the_constraint_holds_exactly_the_parser_s_calls(codec: TextCodec, parser: str) -> None:
    """With llguidance (the structured-output backend): the constraint compiles,
    accepts two calls in the style (which the parser reads back), and refuses prose."""
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    tok = hf.from_tokenizer(codec.hf)
    text = FORCED_OUTPUTS[parser]
    assert len(parse_tool_calls(parser, text).calls) == 2

    def matcher(structured: dict[str, Any]) -> Any:
        ((kind, value),) = structured.items()
        grammar = llguidance.grammar_from(
            "json_schema" if kind == "json" else "lark", value if kind == "grammar" else json.dumps(value)
        )
        m = llguidance.LLMatcher(tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def accepts(structured: dict[str, Any], out: str) -> bool:
        m = matcher(structured)
        ok = m.consume_tokens(codec.backend.encode(out, add_special_tokens=False).ids)
        return bool(ok) and not m.is_error() and m.is_accepting()

    tools = [WEATHER, TIME]
    assert accepts(tool_structured(tools, parser, "", parallel=True), text)
    assert not accepts(tool_structured(tools, parser, "", parallel=False), text)  # one call only
    assert not accepts(tool_structured(tools, parser, "get_time", parallel=True), text)  # the named one only
    assert not accepts(tool_structured(tools, parser, "", parallel=True), "The weather is nice.")


def test_the_tool_parser_option_takes_only_known_styles() -> None:
    assert GatewayConfig(tool_parser="llama3_json").tool_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_parser"):
        GatewayConfig(tool_parser="xml")
