"""Acceptance 1 of issue 12: random and mutated JSON on /v1/chat/completions,
/v1/completions and /v1/ws while good requests stream. No answer is a 5xx (nor an
`internal_error` on the socket or in a stream), the engine never restarts, and every
good request finishes intact with the same text as alone."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

LIMITS = dict(
    max_tokens_limit=32,
    default_max_tokens=8,
    max_n=2,
    max_messages=32,
    max_body_bytes=65536,
    max_ws_message_bytes=65536,
)
MSGS = [{"role": "user", "content": "Tell me about rivers."}]
# The good requests, streamed over and over while the fuzzing runs.
GOOD = [
    (
        "sse",
        "/v1/completions",
        {"prompt": [11, 12, 13, 14], "max_tokens": 32, "temperature": 0, "ignore_eos": True},
    ),
    (
        "sse",
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 32, "temperature": 0.8, "seed": 7, "ignore_eos": True},
    ),
    ("ws", "chat", {"messages": MSGS, "max_tokens": 32, "temperature": 0, "ignore_eos": True}),
]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **LIMITS) as s:
        yield s


async def sse_text(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    text = ""
    async with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


async def ws_text(url: str, kind: str, body: dict[str, Any]) -> str:
    async with websockets.connect(url) as ws:
        await ws.recv()
        await ws.send(orjson.dumps({"type": kind, "id": "good"} | body).decode())
        text = ""
        while (m := orjson.loads(await ws.recv()))["type"] != "done":
            assert m["type"] in ("started", "delta"), m
            text += m.get("text", "")
        return text


async def good_once(srv: Any, http: httpx.AsyncClient) -> list[str]:
    jobs = [
        sse_text(http, where, b) if how == "sse" else ws_text(srv.ws_url, where, b) for how, where, b in GOOD
    ]
    return list(await asyncio.gather(*jobs))


class GoodTraffic:
    """The good requests in a loop on their own thread, until stopped."""

    def __init__(self, srv: Any) -> None:
        self.srv = srv
        self.results: list[list[str]] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        try:
            async with httpx.AsyncClient(base_url=self.srv.base_url, timeout=60) as http:
                while not self.stop.is_set():
                    self.results.append(await good_once(self.srv, http))
        except BaseException as e:  # reported by the test
            self.error = e


# -- what the fuzzer sends ----------------------------------------------------------------------

EDGES = st.sampled_from(
    [
        2**64 - 1,
        2**63,
        -(2**63),
        2**31,
        -1,
        0,
        1,
        1e-300,
        1e308,
        -1e308,
        0.5,
        "",
        "0.5",
        "x" * 300,
        True,
        False,
        None,
        [],
        {},
        [None],
        {"a": 1},
    ]  # fmt: skip
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "n", "ignore_eos", "min_tokens",
    "user", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "use_beam_search", "beam_width",
    "length_penalty", "early_stopping", "messages", "prompt", "type", "id", "after_seq", "resume_token",
    "prompt_logprobs", "logit_bias", "response_format", "structured_outputs", "tools", "tool_choice",
    "chat_template_kwargs", "tokens", "add_special_tokens", "add_generation_prompt",
    "input", "encoding_format", "dimensions",
    # vLLM's extensions (issue 45)
    "return_token_ids", "truncate_prompt_tokens", "continue_final_message",
]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}}}
BASES = [
    {"messages": MSGS, "max_tokens": 4},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    {"prompt": "Once upon", "max_tokens": 4, "n": 2, "stop": ["\n"]},
    {"prompt": [1, 2, 3], "max_tokens": 3, "use_beam_search": True, "beam_width": 2},
    # issue 23's amplifications: prompt tables, structured output, logit_bias keys
    {"prompt": "Once upon a time", "max_tokens": 3, "prompt_logprobs": 5, "logprobs": 2, "echo": True},
    {"messages": MSGS, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"regex": "[a-z]{1,4}"}, "logit_bias": {"42": 5}},
    {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}},
    # vLLM's extensions (issue 45)
    {"messages": MSGS + [{"role": "assistant", "content": "Once"}], "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True, "echo": True, "return_token_ids": True},
    {"prompt": "Once upon a time", "max_tokens": 3, "truncate_prompt_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}},
    # /tokenize and /detokenize
    {"prompt": "Once upon a time", "add_special_tokens": False},
    {"messages": MSGS, "add_generation_prompt": True},
    {"tokens": [1, 2, 3, 4]},
    # /v1/responses and /v1/messages (issue 25)
    {"input": "Once upon a time", "max_output_tokens": 3, "instructions": "Be brief."},
    {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3, "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
    {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"]},
    {"max_tokens": 3, "system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    # /v1/embeddings (issue 25)
    {"input": ["Once upon", "a time"], "encoding_format": "base64", "dimensions": 8},
    {"input": [[1, 2, 3], [4, 5]]},
]  # fmt: skip
JSON_TYPE = "application/json"
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
]
# What a browser's simple request sends: refused with 415 before anything else.
CONTENT_TYPES = ["application/json"] * 17 + ["text/plain", "application/x-www-form-urlencoded", ""]


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any] | list[Any] | Any:
    """A valid body with a few fields set to odd values, dropped or added; or any JSON."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = dict(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(FIELDS)) if draw(st.integers(0, 9)) else draw(st.text(max_size=8))
        action = draw(st.integers(0, 5))
        if action == 0:
            body.pop(key, None)
        else:
            body[key] = draw(EDGES if action <= 3 else JSON)
    return body


def check_http(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400 and r.url.path.startswith("/v1/messages"):  # Anthropic's shape
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert b'"internal_error"' not in r.content, r.text


# -- the test -----------------------------------------------------------------------------------


def test_fuzzed_requests_never_5xx_and_cost_good_streams_nothing(srv: Any) -> None:
    async def alone() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
            return await good_once(srv, http)

    reference = asyncio.run(alone())
    assert all(reference)
    worker_thread = srv.worker._thread
    steps_before = srv.worker.steps
    traffic = GoodTraffic(srv)
    traffic.thread.start()
    try:
        fuzz_http(srv)
        fuzz_ws(srv)
    finally:
        traffic.stop.set()
        traffic.thread.join(120)
    assert traffic.error is None, repr(traffic.error)
    assert len(traffic.results) >= 3, "the good requests did not run during the fuzzing"
    for texts in traffic.results:
        assert texts == reference
    assert srv.worker._thread is worker_thread and worker_thread.is_alive(), "the engine worker restarted"
    assert srv.worker.steps > steps_before
    srv.wait_gateway_forgot()
    srv.assert_no_blocks_held()


def fuzz_http(srv: Any) -> None:
    http = httpx.Client(base_url=srv.base_url, timeout=120)

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        path=st.sampled_from(PATHS),
        body=mutated(),
        raw=st.integers(0, 19),
        ctype=st.sampled_from(CONTENT_TYPES),
    )
    @example(
        "/v1/chat/completions", {"messages": MSGS, "top_k": 18446744073709551615}, 1, JSON_TYPE
    )  # the issue's case
    @example(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 8, "temperature": 1e-300, "top_k": 2**63},
        1,
        JSON_TYPE,
    )
    @example("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 5000}, 1, JSON_TYPE)
    @example("/v1/completions", {"prompt": "hi" * 200, "prompt_logprobs": 20, "max_tokens": 2}, 1, JSON_TYPE)
    @example("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 1, JSON_TYPE)  # issue 23: "²"
    @example("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 1, "text/plain")
    @example("/tokenize", {"prompt": "x" * 60000}, 1, JSON_TYPE)
    def one(path: str, body: Any, raw: int, ctype: str) -> None:
        data = json.dumps(body).encode()  # stdlib: any integer, as a client may send
        content = data if raw else data[: max(1, len(data) // 2)]
        r = http.post(path, content=content, headers={"content-type": ctype} if ctype else {})
        check_http(r)
        if ctype != JSON_TYPE:
            assert r.status_code == 415, r.text

    try:
        one()
    finally:
        http.close()


def fuzz_ws(srv: Any) -> None:
    async def run(messages: list[Any]) -> None:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await ws.recv()
            for i, msg in enumerate(messages):
                if isinstance(msg, dict) and msg.get("type") in ("chat", "completion") and "id" not in msg:
                    msg = msg | {"id": f"f{i}"}
                await ws.send(json.dumps(msg))
                await until_answered(ws, msg)

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(messages=st.lists(mutated().map(lambda b: b | {"type": "chat" if "messages" in b else "completion"} if isinstance(b, dict) and "type" not in b else b), min_size=1, max_size=3))  # fmt: skip
    def one(messages: list[Any]) -> None:
        asyncio.run(run(messages))

    one()


async def until_answered(ws: Any, msg: Any) -> None:
    """Read until the message got its last answer: an error, a pong, or its last done."""
    mid = msg.get("id") if isinstance(msg, dict) else None
    while True:
        m = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
        assert m.get("code") != "internal_error", (msg, m)
        if m["type"] == "error" and m.get("id") in (mid, None) or m["type"] == "pong":
            return
        if m["type"] == "error" and not isinstance(mid, str):
            return
        if m["type"] == "done" and m.get("id") == mid and "usage" in m:
            return
