"""Fields a request may and may not carry, through the real app on the tiny random
model: an unknown field (a typo, a field OpenAI has and wsllm does not serve) is a 400
naming it, over HTTP and the WebSocket, while the documented OpenAI fields that change
nothing here, and the SDK's own message objects sent back, are accepted."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets


def post(srv: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temprature": 0},
            "temprature",
        ),
        ("/v1/completions", {"prompt": "hi", "sufix": "!"}, "sufix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "nmae": "x"}]},
            "messages.0.nmae",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object", "x": 1},
            },
            "response_format.x",
        ),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(
    tiny_server: Any, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(tiny_server, path, body | {"max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: unknown field")


def test_an_unknown_field_on_the_websocket_is_an_error_naming_it(tiny_server: Any) -> None:
    typo = {"type": "chat", "id": "t", "messages": [{"role": "user", "content": "hi"}], "temprature": 0}

    async def go() -> dict[str, Any]:
        async with websockets.connect(tiny_server.ws_url) as ws:
            await ws.recv()  # hello
            await ws.send(orjson.dumps(typo).decode())
            return dict(orjson.loads(await ws.recv()))

    err = asyncio.run(go())
    assert err["type"] == "error" and err["id"] == "t" and err["param"] == "temprature"


def test_openai_fields_with_no_effect_are_accepted(tiny_server: Any, tiny_openai: openai.OpenAI) -> None:
    first = tiny_openai.chat.completions.create(
        model=tiny_server.gateway.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        user="u1",
        store=False,
        metadata={"team": "a"},
        service_tier="auto",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in first if c.choices)
    answer = tiny_openai.chat.completions.create(
        model=tiny_server.gateway.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    # The SDK's own message object sent back (refusal, annotations, audio, function_call
    # as the SDK has them) continues the conversation.
    again = tiny_openai.chat.completions.create(
        model=tiny_server.gateway.model_name,
        messages=[
            {"role": "user", "content": "hi"},
            answer.choices[0].message.model_dump(),  # type: ignore[list-item]
            {"role": "user", "content": "and?"},
        ],
        max_tokens=3,
    )
    assert again.choices[0].finish_reason == "length"
