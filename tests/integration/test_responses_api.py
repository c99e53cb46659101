"""OpenAI's Responses API through the real app and the official `openai` client (tiny
random model, memory broker): answers streamed and not agree, the SDK's own stream
helper assembles the typed events into the same response, a required tool call round
trips (by `previous_response_id` and by sending the output back), a `text.format`
json_schema answer is valid (the constraint, not the model, makes it so), a stored
response continues a conversation and is another key's 404, a closed stream frees its
engine request, a deleted background response stops and stays deleted, and calls on
stored responses take from the tenant's rpm."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
import websockets

KEYS = """
[tenants.alice]
keys = ["sk-alice"]

[tenants.bob]
keys = ["sk-bob"]

[tenants.carl]
keys = ["sk-carl"]
rpm = 3
"""
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# room for a whole call, and one call only: the constraint then ends the answer
ONE_CALL = {"max_output_tokens": 200, "parallel_tool_calls": False}
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 1000},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "population", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with live_server(tiny_engine, api_keys_file=str(path), api_key="sk-admin") as s:
        yield s


def client(srv: Any, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0)


def kw(srv: Any, **extra: Any) -> dict[str, Any]:
    return {"model": srv.gateway.model_name, "temperature": 0, "max_output_tokens": 12} | extra


def test_streamed_and_whole_answers_agree_and_the_sdk_assembles_the_events(srv: Any) -> None:
    c = client(srv)
    args = kw(srv, input="Tell me about Oslo.", instructions="Be brief.")
    whole = c.responses.create(**args)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens <= 12
    events = list(c.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done"} <= set(
        kinds
    )
    if whole.status == "incomplete":  # cut by max_output_tokens
        assert kinds[-1] == "response.incomplete" and whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"


def test_a_required_tool_call_round_trips(srv: Any) -> None:
    c = client(srv)
    first = c.responses.create(
        **kw(srv, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", **ONE_CALL)
    )
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(orjson.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": -3}'}
    # by previous_response_id ...
    by_id = c.responses.create(**kw(srv, input=[result], previous_response_id=first.id, tools=[WEATHER]))
    assert by_id.status in ("completed", "incomplete") and by_id.previous_response_id == first.id
    # ... and by sending the output items back, as the SDK returned them
    items = [o.model_dump(exclude_none=True) for o in first.output] + [result]
    sent = c.responses.create(
        **kw(srv, input=[{"role": "user", "content": "Weather in Oslo?"}, *items], tools=[WEATHER])
    )
    assert sent.usage is not None and by_id.usage is not None
    assert sent.usage.input_tokens == by_id.usage.input_tokens  # the same conversation
    assert sent.output_text == by_id.output_text


def test_a_streamed_tool_call_sends_its_arguments(srv: Any) -> None:
    c = client(srv)
    tc = {"type": "function", "name": "get_weather"}
    events = list(
        c.responses.create(
            **kw(srv, input="Weather?", tools=[WEATHER], tool_choice=tc, stream=True, **ONE_CALL)
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args and done.name == "get_weather"
    jsonschema.validate(orjson.loads(args), WEATHER["parameters"])
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert items[-1].type == "function_call" and items[-1].arguments == args


def test_text_format_json_schema_is_followed(srv: Any) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    c = client(srv)
    args = kw(srv, input="Describe a city.", text=fmt, max_output_tokens=200)
    r = c.responses.create(**args)
    assert r.status == "completed"
    jsonschema.validate(orjson.loads(r.output_text), CITY)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    # The SDK's stream helper checks item identities and indexes as it assembles the
    # events, and wants `response.completed`: the schema's end makes the answer end.
    with c.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_previous_response_id_continues_and_another_key_cannot_read_it(srv: Any) -> None:
    alice, bob = client(srv), client(srv, "sk-bob")
    first = alice.responses.create(**kw(srv, input="My name is Ada."))
    second = alice.responses.create(**kw(srv, input="What is my name?", previous_response_id=first.id))
    assert first.usage is not None and second.usage is not None
    # the second prompt holds the first turn: its input and its answer
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert alice.responses.retrieve(second.id).output_text == second.output_text
    items = alice.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items[1].content[0].text == first.output_text and items[2].content[0].text == "What is my name?"
    page = alice.responses.input_items.list(second.id, limit=1)  # newest first, then the rest
    assert [i.id for i in page.data] == [items[2].id] and page.has_more
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(second.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as e:
        bob.responses.create(**kw(srv, input="Hi", previous_response_id=first.id))
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(second.id)
    alice.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(second.id)
    unstored = alice.responses.create(**kw(srv, input="Hi", store=False))
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input.0.call_id"),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "background": True, "stream": True}, "background"),
        ({"input": "hi", "conversation": "c1"}, "conversation"),
        (
            {"input": "hi", "tool_choice": {"type": "function", "name": "f"}, "tools": [WEATHER]},
            "tool_choice.name",
        ),
        ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "word " * 3000}, "input"),  # past the context: preparation's 400, renamed
        ({"input": "hi", "max_output_tokens": 4000}, "max_output_tokens"),  # prompt + it past the context
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_bad_fields_are_a_400_naming_them(srv: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{srv.base_url}/v1/responses", json=body, headers={"authorization": "Bearer sk-alice"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_closing_a_stream_frees_its_engine_request(srv: Any) -> None:
    body = {"input": "Go on and on.", "max_output_tokens": 2000, "stream": True, "temperature": 1}
    headers = {"authorization": "Bearer sk-alice"}
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    srv.wait_gateway_forgot()
    srv.assert_no_blocks_held()


def test_a_websocket_responses_message_streams_the_same_events(srv: Any) -> None:
    body = {"input": "Tell me about Oslo.", "temperature": 0, "max_output_tokens": 8}
    whole = client(srv).responses.create(model=srv.gateway.model_name, **body)

    async def run() -> list[dict[str, Any]]:
        headers = {"authorization": "Bearer sk-alice"}
        async with websockets.connect(srv.ws_url, additional_headers=headers) as ws:
            assert orjson.loads(await ws.recv())["type"] == "hello"
            await ws.send(orjson.dumps({"type": "responses", "id": "r1"} | body).decode())
            started = orjson.loads(await ws.recv())
            assert started["type"] == "started" and started["response_id"].startswith("resp_")
            events = []
            while not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
                msg = orjson.loads(await ws.recv())
                assert msg["type"] == "response_event" and msg["id"] == "r1", msg
                events.append(msg["event"])
            await ws.send(orjson.dumps({"type": "responses", "id": "r2", "input": []}).decode())
            err = orjson.loads(await ws.recv())
            assert err["type"] == "error" and err["id"] == "r2" and err["param"] == "input", err
            long = {"type": "responses", "id": "r3", "input": "Go on.", "max_output_tokens": 2000}
            await ws.send(orjson.dumps(long).decode())
            assert orjson.loads(await ws.recv())["type"] == "started"
            await ws.send(orjson.dumps({"type": "cancel", "id": "r3"}).decode())
            last: dict[str, Any] = {}
            while last.get("type") != "response.completed":
                last = orjson.loads(await ws.recv())["event"]
            assert last["response"]["status"] == "cancelled"
            return events

    events = asyncio.run(run())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text and events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert client(srv).responses.retrieve(events[-1]["response"]["id"]).output_text == text


def test_a_background_response_runs_without_its_client_and_can_be_cancelled(srv: Any) -> None:
    alice, bob = client(srv), client(srv, "sk-bob")
    short = alice.responses.create(**kw(srv, input="Hi", background=True, max_output_tokens=4))
    assert short.background and short.status == "in_progress"
    deadline = time.monotonic() + 60
    while (got := alice.responses.retrieve(short.id)).status == "in_progress":
        assert time.monotonic() < deadline, "the background response never ended"
        time.sleep(0.05)
    assert (
        got.status in ("completed", "incomplete") and got.usage is not None and got.usage.output_tokens == 4
    )
    long = alice.responses.create(
        **kw(srv, input="Go on and on.", background=True, max_output_tokens=2000, temperature=1)
    )
    assert alice.responses.retrieve(long.id).status == "in_progress"
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(long.id)
    cancelled = alice.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and alice.responses.retrieve(long.id).status == "cancelled"
    assert cancelled.usage is not None and cancelled.usage.output_tokens < 2000
    assert alice.responses.cancel(long.id).status == "cancelled"  # again: as it is
    srv.assert_no_blocks_held()
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(
            short.id if not short.background else alice.responses.create(**kw(srv, input="x")).id
        )


def test_deleting_a_background_response_stops_it_and_it_stays_deleted(srv: Any) -> None:
    alice = client(srv)
    r = alice.responses.create(
        **kw(srv, input="Go on and on.", background=True, max_output_tokens=2000, temperature=1)
    )
    assert alice.responses.retrieve(r.id).status == "in_progress"
    with pytest.raises(openai.NotFoundError):
        client(srv, "sk-bob").responses.delete(r.id)
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    srv.assert_engine_forgot("resp-" + r.id.removeprefix("resp_"))  # the run stopped
    srv.assert_no_blocks_held()
    with pytest.raises(openai.NotFoundError):  # and its end did not store it again
        alice.responses.retrieve(r.id)


def test_calls_on_stored_responses_take_from_the_rpm(srv: Any) -> None:
    """GET, cancel and DELETE of a stored response were free: a key could read one a
    thousand times a second."""
    carl = client(srv, "sk-carl")
    r = carl.responses.create(**kw(srv, input="Hi", max_output_tokens=2))  # 1 of 3
    carl.responses.retrieve(r.id)  # 2
    carl.responses.input_items.list(r.id)  # 3
    for call in (carl.responses.retrieve, carl.responses.delete, carl.responses.cancel):
        with pytest.raises(openai.RateLimitError):
            call(r.id)
