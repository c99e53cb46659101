"""A list of prompts in one /v1/completions call, through the real app on the tiny
random model: vLLM's numbering (index = prompt's index * n + choice), usage summed,
streamed and not; a bad list is refused by name and holds nothing; the WebSocket,
which takes one prompt per request, refuses a list and points to the HTTP route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets

PROMPTS = ["Once upon a time", "The weather today", "A list of numbers:"]
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
MAX_PROMPTS = 4


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, max_prompts=MAX_PROMPTS) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


def post(srv: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{path}", json=body, timeout=60)


def stream_chunks(srv: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", f"{srv.base_url}/v1/completions", json=body | {"stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(orjson.loads(line[6:]))
    return chunks


def test_a_list_of_prompts_answers_each_as_its_own_request_would(srv: Any, client: openai.OpenAI) -> None:
    kw: Any = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    singles = [client.completions.create(model=srv.gateway.model_name, prompt=p, n=2, **kw) for p in PROMPTS]
    got = client.completions.create(model=srv.gateway.model_name, prompt=PROMPTS, n=2, **kw)
    # vLLM's numbering: prompt 0's choices, then prompt 1's, ...
    assert [c.index for c in got.choices] == list(range(2 * len(PROMPTS)))
    assert [c.text for c in got.choices] == [c.text for s in singles for c in s.choices]
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage is not None
    assert got.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert got.usage.completion_tokens == 2 * len(PROMPTS) * GREEDY["max_tokens"]
    # token ids work the same way, and echo puts each choice's own prompt first
    ids = [srv.gateway.codec.encode(p) for p in PROMPTS[:2]]
    by_ids = post(srv, "/v1/completions", {"prompt": ids, "echo": True} | GREEDY).json()
    assert [c["text"] for c in by_ids["choices"]] == [
        p + c.text for p, s in zip(PROMPTS[:2], singles, strict=False) for c in s.choices[:1]
    ]
    srv.assert_no_blocks_held()


def test_a_streamed_list_of_prompts_assembles_to_the_same_choices(srv: Any) -> None:
    body = {"prompt": PROMPTS, "n": 2} | GREEDY
    whole = post(srv, "/v1/completions", body).json()
    chunks = stream_chunks(srv, body | {"stream_options": {"include_usage": True}})
    assert len({c["id"] for c in chunks}) == 1  # one call, one id
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {c["index"]: "length" for c in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    srv.assert_no_blocks_held()


def test_a_bad_list_of_prompts_is_refused_by_name_and_holds_nothing(srv: Any) -> None:
    too_many = post(srv, "/v1/completions", {"prompt": ["a"] * (MAX_PROMPTS + 1)} | GREEDY)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert str(MAX_PROMPTS) in too_many.json()["error"]["message"]
    assert post(srv, "/v1/completions", {"prompt": []} | GREEDY).status_code == 400
    # the second prompt has a token id past the vocabulary: the first, started, is freed
    vocab = srv.gateway.codec.vocab_size
    bad = post(srv, "/v1/completions", {"prompt": [[1, 2, 3], [1, vocab + 5]], "max_tokens": 200})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt.1"
    srv.wait_gateway_forgot()
    srv.assert_no_blocks_held()


def test_a_list_of_prompts_on_the_websocket_is_an_error_naming_the_http_route(srv: Any) -> None:
    async def go() -> dict[str, Any]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.recv()  # hello
            await ws.send(orjson.dumps({"type": "completion", "id": "b", "prompt": ["a", "b"]}).decode())
            return dict(orjson.loads(await ws.recv()))

    batch = asyncio.run(go())
    assert batch["type"] == "error" and batch["param"] == "prompt" and "/v1/completions" in batch["message"]
