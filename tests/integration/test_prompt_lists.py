"""Issue 13's fill-ins, through the real app on the tiny random model: a list of prompts
in one /v1/completions call (vLLM's numbering: index = prompt's index * n + choice, usage
summed), vLLM's /tokenize and /detokenize, and unknown fields refused by name while the
documented OpenAI fields with no effect are accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import transformers
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


# -- a list of prompts --------------------------------------------------------------------


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
    body = {"prompt": PROMPTS, "n": 2, "stream_options": {"include_usage": True}} | GREEDY
    whole = post(srv, "/v1/completions", body).json()
    chunks = stream_chunks(srv, body)
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


def test_a_list_of_prompts_and_an_unknown_field_are_errors_on_the_websocket(srv: Any) -> None:
    async def go(*messages: dict[str, Any]) -> list[dict[str, Any]]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.recv()  # hello
            out = []
            for m in messages:
                await ws.send(orjson.dumps(m).decode())
                out.append(dict(orjson.loads(await ws.recv())))
            return out

    batch, typo = asyncio.run(
        go(
            {"type": "completion", "id": "b", "prompt": ["a", "b"]},
            {"type": "chat", "id": "t", "messages": [{"role": "user", "content": "hi"}], "temprature": 0},
        )
    )
    assert batch["type"] == "error" and batch["param"] == "prompt" and "/v1/completions" in batch["message"]
    assert typo["type"] == "error" and typo["id"] == "t" and typo["param"] == "temprature"


# -- /tokenize and /detokenize --------------------------------------------------------------


def test_tokenize_counts_what_the_generate_routes_count(srv: Any, client: openai.OpenAI) -> None:
    text = "Tokens, counted before sending: 12345!"
    tok = post(srv, "/tokenize", {"model": srv.gateway.model_name, "prompt": text}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM's TokenizeResponse
    assert tok["token_strs"] is None and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == srv.engine.max_model_len
    done = client.completions.create(model=srv.gateway.model_name, prompt=text, max_tokens=1)
    assert done.usage is not None and tok["count"] == done.usage.prompt_tokens
    # a chat's messages go through the template exactly as a chat request's do
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat_tok = post(srv, "/tokenize", {"messages": messages}).json()
    chat = client.chat.completions.create(model=srv.gateway.model_name, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat_tok["count"] == chat.usage.prompt_tokens
    bare = post(srv, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert chat_tok["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat_tok["count"]
    strs = post(srv, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    hf = transformers.AutoTokenizer.from_pretrained(srv.engine.model_dir)
    assert strs == hf.convert_ids_to_tokens(tok["tokens"])  # vLLM's token_strs


def test_detokenize_inverts_tokenize_and_checks_the_vocabulary(srv: Any) -> None:
    text = "Round trip: héllo wörld"
    ids = post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = post(srv, "/detokenize", {"model": srv.gateway.model_name, "tokens": ids})
    assert back.json() == {"prompt": text}  # vLLM's DetokenizeResponse
    vocab = srv.gateway.codec.vocab_size
    bad = post(srv, "/detokenize", {"tokens": [1, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    missing = post(srv, "/tokenize", {"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    typo = post(srv, "/tokenize", {"prompt": "x", "add_special_token": True})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "add_special_token"


# -- unknown fields -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temprature": 0},
            "temprature",
        ),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
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
def test_an_unknown_field_is_a_400_naming_it(srv: Any, path: str, body: dict[str, Any], param: str) -> None:
    r = post(srv, path, body | {"max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: unknown field")


def test_openai_fields_with_no_effect_are_accepted(srv: Any, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=srv.gateway.model_name,
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
    answer = client.chat.completions.create(
        model=srv.gateway.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    # The SDK's own message object sent back (refusal, annotations, audio, function_call
    # as the SDK has them) continues the conversation.
    again = client.chat.completions.create(
        model=srv.gateway.model_name,
        messages=[
            {"role": "user", "content": "hi"},
            answer.choices[0].message.model_dump(),  # type: ignore[list-item]
            {"role": "user", "content": "and?"},
        ],
        max_tokens=3,
    )
    assert again.choices[0].finish_reason == "length"
