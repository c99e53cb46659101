"""The official openai client against a live gateway: chat and completions, streamed
and not; greedy text equals LLM.generate; 64 concurrent SSE streams and /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from wsllm import SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"


def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)


# -- SmolLM2: the text through the API equals LLM.generate ---------------------------------


@pytest.fixture(scope="module")
def expected(smollm_llm: Any) -> dict[str, str]:
    """Greedy text from the offline API, computed before the server takes the engine."""
    tok = smollm_llm.tokenizer
    chat_ids = tok.encode(
        tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    beam = SamplingParams(temperature=0.0, max_tokens=12, use_beam_search=True, beam_width=4, n=2)
    chat, completion, beams = smollm_llm.generate([chat_ids, PROMPT, PROMPT], [params, params, beam])
    return {
        "chat": chat.text,
        "completion": completion.text,
        "beam0": beams.outputs[0].text,
        "beam1": beams.outputs[1].text,
    }


@pytest.fixture(scope="module")
def smollm_server(live_server: Any, smollm_engine: Any, expected: dict[str, str]) -> Iterator[Any]:
    with live_server(smollm_engine) as srv:
        yield srv


def test_greedy_chat_equals_llm_generate(smollm_server: Any, expected: dict[str, str]) -> None:
    c = client(smollm_server)
    model = smollm_server.gateway.model_name
    r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected["chat"]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 10
    stream = c.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected["chat"]


def test_greedy_completion_equals_llm_generate(smollm_server: Any, expected: dict[str, str]) -> None:
    c = client(smollm_server)
    model = smollm_server.gateway.model_name
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected["completion"]
    stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == expected["completion"]


def test_beam_search_completion_equals_llm_generate(smollm_server: Any, expected: dict[str, str]) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "use_beam_search": True,
        "beam_width": 4,
        "n": 2,
    }
    r = httpx.post(f"{smollm_server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [expected["beam0"], expected["beam1"]]
    bad = httpx.post(f"{smollm_server.base_url}/v1/completions", json={**body, "beam_width": 99}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "beam_width"


# -- the tiny model: shapes, options, concurrency ---------------------------------------------


@pytest.fixture(scope="module")
def tiny(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine) as srv:
        yield srv


def test_chat_stream_with_usage_ids_and_n(tiny: Any) -> None:
    c = client(tiny)
    chunks = list(
        c.chat.completions.create(
            model=tiny.gateway.model_name,
            messages=CHAT,
            max_tokens=8,
            temperature=0.8,
            seed=3,
            n=2,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert {ch.id for ch in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    finishes = {c.index: c.finish_reason for ch in deltas for c in ch.choices if c.finish_reason}
    assert finishes == {0: "length", 1: "length"}
    assert all(ch.usage is None for ch in deltas)


def test_completion_non_stream_shape_and_logprobs(tiny: Any) -> None:
    r = client(tiny).completions.create(
        model=tiny.gateway.model_name,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    ch = r.choices[0]
    assert r.object == "text_completion" and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == 5 and len(ch.logprobs.top_logprobs[0]) >= 1
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_streamed_text_equals_non_streamed_text(tiny: Any) -> None:
    """The random model emits odd bytes and tokens: streaming must not change the text."""
    c = client(tiny)
    kw = dict(
        model=tiny.gateway.model_name,
        prompt=[5, 900, 17, 2048],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = c.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == full


def test_sse_wire_format_has_ids_and_done(tiny: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny.base_url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert [e.splitlines()[0] for e in events[:-1]] == [f"id: {i}" for i in range(1, len(events))]


def test_sse_heartbeat_while_waiting(tiny: Any) -> None:
    # A comment line comes when no token is ready within heartbeat_s.
    tiny.gateway.cfg.heartbeat_s, old = 0.001, tiny.gateway.cfg.heartbeat_s
    try:
        body = {"prompt": PROMPT, "max_tokens": 30, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{tiny.base_url}/v1/completions", json=body) as r:
            text = r.read().decode()
    finally:
        tiny.gateway.cfg.heartbeat_s = old
    assert ": keepalive" in text and text.endswith("data: [DONE]\n\n")


def test_models_health_ready(tiny: Any) -> None:
    models = client(tiny).models.list()
    assert [m.id for m in models.data] == [tiny.gateway.model_name]
    assert httpx.get(f"{tiny.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny.base_url}/ready").status_code == 200


def test_64_concurrent_sse_streams_complete_and_are_counted(tiny: Any) -> None:
    n = 64
    before = tiny.metric("wsllm_requests_total", api="completions", finish_reason="length")
    ttft_before = tiny.metric("wsllm_time_to_first_token_seconds_count")
    prompts = [[7 + i, 300 + 11 * i, 4000 + i] for i in range(n)]

    async def one(http: httpx.AsyncClient, prompt: list[int], stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
        if not stream:
            r = await http.post("/v1/completions", json=body)
            return str(r.json()["choices"][0]["text"])
        text, done = [], False
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += [c["text"] for c in orjson.loads(line[6:])["choices"]]
        assert done
        return "".join(text)

    async def run() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=2 * n)
        async with httpx.AsyncClient(base_url=tiny.base_url, limits=limits, timeout=120) as http:
            streamed = await asyncio.gather(*(one(http, p, True) for p in prompts))
            plain = await asyncio.gather(*(one(http, p, False) for p in prompts))
        return streamed, plain

    streamed, plain = asyncio.run(run())
    assert streamed == plain  # each stream got its own content, complete
    assert len(set(streamed)) > n // 2
    assert tiny.metric("wsllm_requests_total", api="completions", finish_reason="length") - before == 2 * n
    assert tiny.metric("wsllm_time_to_first_token_seconds_count") - ttft_before == 2 * n
    assert tiny.metric("wsllm_generation_tokens_total") >= 2 * n * 12
    tiny.assert_no_blocks_held()
