"""Anthropic's Messages API through the real app (tiny random model, the official
`anthropic` client): create streamed and not, a tool_use -> tool_result round trip
forced through the tool constraint, stop_sequences, count_tokens equal to the prompt
tokens a create reports, x-api-key auth, and Anthropic's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import orjson
import pytest

KEY = "messages-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,  # else a random model writes more until max_tokens
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0)


def _kw(srv: Any, **extra: Any) -> dict[str, Any]:
    # temperature 0 (greedy): this SDK version takes sampling fields through extra_body only
    body = dict(model=srv.gateway.model_name, max_tokens=16, messages=ASK) | extra
    return body | {"extra_body": {"temperature": 0.0}}


def _body(srv: Any, **extra: Any) -> dict[str, Any]:
    """A JSON body for httpx (no SDK)."""
    return dict(model=srv.gateway.model_name, max_tokens=16, temperature=0.0, messages=ASK) | extra


def _streamed(client: anthropic.Anthropic, kw: dict[str, Any]) -> Any:
    with client.messages.stream(**kw) as stream:
        return stream.get_final_message()


def _prompt_tokens(msg: Any) -> int:
    """The whole prompt: the tokens the cache did not serve and those it did (disjoint)."""
    return int(msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0))


def _blocks(msg: Any) -> list[dict[str, Any]]:
    """The content blocks, less the call ids (each request has its own)."""
    return [b.model_dump(exclude_none=True, exclude={"id"}) for b in msg.content]


def test_create_streamed_and_not_give_the_same_message(srv: Any, client: anthropic.Anthropic) -> None:
    kw = _kw(srv, system="Answer briefly.")
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == srv.gateway.model_name
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 16
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert _blocks(streamed) == _blocks(msg)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (msg.stop_reason, msg.usage.output_tokens)
    assert _prompt_tokens(streamed) == _prompt_tokens(msg)
    raw = list(client.messages.create(**kw, stream=True))  # the raw events, no helper
    text = "".join(
        e.delta.text for e in raw if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert text == "".join(b.text for b in msg.content if b.type == "text")
    assert [e.type for e in raw][-2:] == ["message_delta", "message_stop"]


def test_count_tokens_equals_the_prompt_tokens_a_create_reports(
    srv: Any, client: anthropic.Anthropic
) -> None:
    prompt = dict(
        model=srv.gateway.model_name,
        system=[{"type": "text", "text": "You check the weather."}],
        messages=ASK,
        tools=[WEATHER],
    )
    counted = client.messages.count_tokens(**prompt)  # type: ignore[arg-type]
    made = client.messages.create(**prompt, max_tokens=4)  # type: ignore[arg-type]
    assert counted.input_tokens == _prompt_tokens(made)
    # the tools are in the prompt: without them it is shorter
    bare = client.messages.count_tokens(model=srv.gateway.model_name, messages=ASK)  # type: ignore[arg-type]
    assert bare.input_tokens < counted.input_tokens


def test_usage_adds_up_to_count_tokens_before_and_after_a_cache_hit(
    srv: Any, client: anthropic.Anthropic
) -> None:
    """Anthropic's three input fields are disjoint: `input_tokens` counts the prompt tokens
    the cache did not serve, so `input_tokens + cache_read_input_tokens` is the prompt,
    whole or streamed (the SDK's final message takes message_delta's usage)."""
    system = "You answer questions about the weather. " * 12  # several KV blocks, cached once run
    kw = _kw(srv, system=system, max_tokens=4)
    prompt = client.messages.count_tokens(model=kw["model"], system=system, messages=ASK).input_tokens
    reads = []
    for _ in range(2):
        for msg in (client.messages.create(**kw), _streamed(client, kw)):
            u = msg.usage
            assert u.input_tokens + (u.cache_read_input_tokens or 0) == prompt, u
            reads.append(u.cache_read_input_tokens or 0)
        raw = list(client.messages.create(**kw, stream=True))
        start = next(e for e in raw if e.type == "message_start").message.usage
        assert start.input_tokens + (start.cache_read_input_tokens or 0) == prompt
    assert reads[-1] > 0 and reads[-1] >= prompt // 2  # the hit: the most of the prompt was cached


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ],
)
def test_a_forced_tool_use_round_trips_through_tool_result(
    srv: Any, client: anthropic.Anthropic, choice: dict[str, Any]
) -> None:
    kw = _kw(srv, tools=[WEATHER], tool_choice=choice, max_tokens=120)
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    streamed = _streamed(client, kw)  # its input assembled from input_json_delta events
    assert _blocks(streamed) == _blocks(msg)
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "-3 C"}]},
    ]
    answer = client.messages.create(**_kw(srv, tools=[WEATHER], messages=follow))
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert _prompt_tokens(answer) > _prompt_tokens(msg)  # the call and its result are in the prompt


def test_stop_sequences_end_the_text_and_name_the_sequence(srv: Any, client: anthropic.Anthropic) -> None:
    free = client.messages.create(**_kw(srv, max_tokens=24))
    text = "".join(b.text for b in free.content if b.type == "text")
    assert len(text) > 6, "the tiny model's answer is long enough to cut"
    stop = text[4:7]
    kw = _kw(srv, max_tokens=24, stop_sequences=["NEVER-SEEN", stop])
    for msg in (client.messages.create(**kw), _streamed(client, kw)):
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in msg.content if b.type == "text") == text[: text.find(stop)]


def test_x_api_key_and_bearer_are_both_accepted_and_a_wrong_key_is_anthropic_shaped(srv: Any) -> None:
    body = _body(srv, max_tokens=2)
    url = f"{srv.base_url}/v1/messages"
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    ok = httpx.post(url, json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(**_kw(srv, max_tokens=2))
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="},
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.type",
            "document blocks are not supported",
        ),
        ({"max_tokens": None}, "max_tokens", "required"),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
            "tool_choice.name",
            "not one of",
        ),
        ({"stop_sequences": [""]}, "stop_sequences", "stop string"),
        ({"temperature": "hot"}, "temperature", ""),
    ],
)
def test_bad_requests_are_a_400_in_anthropic_shape_naming_the_field(
    srv: Any, change: dict[str, Any], param: str, words: str
) -> None:
    body = {k: v for k, v in (_body(srv) | change).items() if v is not None}
    r = httpx.post(f"{srv.base_url}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param) and words in err["error"]["message"]


def test_closing_a_streamed_message_aborts_its_engine_request(srv: Any) -> None:
    """Nothing resumes a message stream: a client that leaves frees the engine request."""
    aborts = srv.metric("wsllm_request_aborts_total")
    body = _body(srv, max_tokens=2000, stream=True)
    with httpx.stream("POST", f"{srv.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        events = (orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        rid = next(events)["message"]["id"]  # message_start: sent before the engine has it
        next(e for e in events if e["type"] == "content_block_delta")
        assert srv.engine.is_known(rid)
    srv.assert_engine_forgot(rid)
    assert srv.metric("wsllm_request_aborts_total") - aborts == 1
    srv.assert_no_blocks_held()


def test_output_config_format_gives_json_that_follows_the_schema(
    srv: Any, client: anthropic.Anthropic
) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 8}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    kw = _kw(srv, max_tokens=60)
    kw["extra_body"]["output_config"] = fmt  # newer SDKs take it as a parameter too
    msg = client.messages.create(**kw)
    (block,) = msg.content
    assert block.type == "text" and msg.stop_reason == "end_turn"
    jsonschema.validate(orjson.loads(block.text), schema)


def test_a_route_not_served_under_messages_is_anthropic_shaped(srv: Any) -> None:
    """Batches are not served: the UI's static mount answers 405, in Anthropic's shape."""
    r = httpx.post(f"{srv.base_url}/v1/messages/batches", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "Method Not Allowed"},
    }
