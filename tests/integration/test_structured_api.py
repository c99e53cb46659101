"""Structured output through the real app (issue 13): the `openai` client's `parse()`
with a Pydantic model, vLLM's `structured_outputs` (choice, regex), a forced tool call,
and `logit_bias`, on a random-weight tiny model, so that the constraint, not the model,
is what makes the answers valid. Bad specs are a 400 naming the field."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from wsllm.server.chat.output import assemble_tool_calls

MESSAGES = [{"role": "user", "content": "Describe a city."}]


class Size(enum.Enum):
    small = "small"
    large = "large"


class District(BaseModel):
    name: str = Field(max_length=8)
    size: Size


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int = Field(ge=0, le=1000)
    area_km2: float = Field(ge=0.5, le=2.0)
    districts: list[District] = Field(max_length=2)
    capital: bool


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            },
            "required": ["city", "year"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parse_returns_a_valid_object_of_a_pydantic_model(srv: Any, client: openai.OpenAI, seed: int) -> None:
    r = client.beta.chat.completions.parse(
        model=srv.gateway.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=City,
        max_tokens=400,
        temperature=1.0,
        seed=seed,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens
    jsonschema.validate(orjson.loads(r.choices[0].message.content or ""), City.model_json_schema())


def test_choice_regex_and_json_object_hold_on_http_and_the_websocket(srv: Any, client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=srv.gateway.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}},
        n=3,
        temperature=1.0,
        seed=3,
    )
    assert {c.message.content for c in choice.choices} <= {"alpha", "beta gamma"}
    regex = client.completions.create(
        model=srv.gateway.model_name,
        prompt="Date:",
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}},
        max_tokens=20,
        temperature=1.0,
        seed=4,
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", regex.choices[0].text), regex.choices[0].text
    obj = client.chat.completions.create(
        model=srv.gateway.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0,
    )
    if obj.choices[0].finish_reason == "stop":  # a free object may run to max_tokens
        assert isinstance(orjson.loads(obj.choices[0].message.content or ""), dict)

    import asyncio

    import websockets

    async def ws() -> str:
        async with websockets.connect(srv.ws_url) as sock:
            await sock.recv()
            msg = {
                "type": "chat",
                "id": "s",
                "messages": MESSAGES,
                "structured_outputs": {"choice": ["yes", "no"]},
            }
            await sock.send(orjson.dumps(msg).decode())
            text = ""
            while (m := orjson.loads(await sock.recv()))["type"] != "done":
                assert m["type"] != "error", m
                text += m.get("text", "") if m["type"] == "delta" else ""
            return text

    assert asyncio.run(ws()) in ("yes", "no")


def test_a_required_tool_call_follows_the_functions_schema_streamed_and_not(
    srv: Any, client: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        messages=MESSAGES,
        tools=[LOOKUP],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    counted = srv.metric("wsllm_requests_total", api="chat", finish_reason="tool_calls")
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    # the server counts the answer as the client was told it ended
    assert srv.metric("wsllm_requests_total", api="chat", finish_reason="tool_calls") == counted + 1
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    jsonschema.validate(orjson.loads(calls[0].function.arguments), LOOKUP["function"]["parameters"])
    deltas = [
        tc.model_dump()
        for chunk in client.chat.completions.create(**kw, stream=True)
        for ch in chunk.choices
        for tc in ch.delta.tool_calls or []
    ]
    streamed = assemble_tool_calls(deltas)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_logit_bias_forces_and_bans_tokens(srv: Any) -> None:
    def tokens(bias: dict[str, float]) -> list[str]:
        r = httpx.post(
            f"{srv.base_url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
            | {"logit_bias": bias},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["logprobs"]["tokens"])

    plain = tokens({})
    assert tokens({"1000": 100}) == [tokens({"1000": 100})[0]] * 6  # one token, every time
    banned = tokens({str(t): -100 for t in _ids(srv, plain[:1])})
    assert banned[0] != plain[0]


def _ids(srv: Any, pieces: list[str]) -> list[int]:
    codec = srv.gateway.codec
    return [codec.hf.convert_tokens_to_ids(codec.hf.tokenize(p))[0] for p in pieces]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)  # fmt: skip
def test_a_bad_spec_is_a_400_naming_the_field(srv: Any, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(
        f"{srv.base_url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 4} | extra,
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["message"].startswith(param), err
