"""Bad input gets the right status and an OpenAI-shaped error, and never costs the
next request anything. The same validator serves HTTP and the WebSocket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets

KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMITS = dict(
    api_key=KEY,
    max_body_bytes=16384,
    max_ws_message_bytes=4096,
    max_n=4,
    max_tokens_limit=256,
    max_stop=3,
    max_stop_len=16,
    max_top_logprobs=5,
)
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **LIMITS) as s:
        yield s


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 2} | kw


def comp(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2} | kw


# (case, path, body (dict or raw bytes), status, error code, param)
CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    ("temperature as a string", "chat", chat(temperature="0.5"), 400, "invalid_request", "temperature"),
    ("max_tokens as a float", "chat", chat(max_tokens=1.5), 400, "invalid_request", "max_tokens"),
    ("n as a bool", "chat", chat(n=True), 400, "invalid_request", "n"),
    ("stream as a string", "completions", comp(stream="yes"), 400, "invalid_request", "stream"),
    ("messages as a string", "chat", {"messages": "hi"}, 400, "invalid_request", "messages"),
    (
        "content as a number",
        "chat",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_request",
        "messages.0.content",
    ),
    ("negative temperature", "chat", chat(temperature=-1), 400, "invalid_request", "temperature"),
    ("temperature over 2", "completions", comp(temperature=2.5), 400, "invalid_request", "temperature"),
    ("top_p of 0", "chat", chat(top_p=0), 400, "invalid_request", "top_p"),
    ("presence_penalty 5", "chat", chat(presence_penalty=5), 400, "invalid_request", "presence_penalty"),
    ("top_k -2", "completions", comp(top_k=-2), 400, "invalid_request", "top_k"),
    ("negative seed", "completions", comp(seed=-1), 400, "invalid_request", "seed"),
    ("max_tokens 0", "completions", comp(max_tokens=0), 400, "invalid_request", "max_tokens"),
    (
        "NaN",
        "chat",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "invalid_json",
        None,
    ),
    (
        "infinity",
        "chat",
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}',
        400,
        "invalid_json",
        None,
    ),
    ("empty prompt", "completions", comp(prompt=""), 400, "invalid_request", "prompt"),
    ("empty token prompt", "completions", comp(prompt=[]), 400, "invalid_request", "prompt"),
    (
        "token id outside the vocabulary",
        "completions",
        comp(prompt=[1, 10**9]),
        400,
        "invalid_request",
        "prompt",
    ),
    (
        "stop id outside the vocabulary",
        "chat",
        chat(stop_token_ids=[10**9]),
        400,
        "invalid_request",
        "stop_token_ids",
    ),
    ("empty messages", "chat", {"messages": []}, 400, "invalid_request", "messages"),
    ("no messages", "chat", {"max_tokens": 3}, 400, "invalid_request", "messages"),
    (
        "unknown role",
        "chat",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "invalid_request",
        "messages.0.role",
    ),
    ("too many stop strings", "chat", chat(stop=["a", "b", "c", "d"]), 400, "invalid_request", "stop"),
    ("stop string too long", "chat", chat(stop="x" * 17), 400, "invalid_request", "stop"),
    ("empty stop string", "chat", chat(stop=[""]), 400, "invalid_request", "stop"),
    ("huge n", "chat", chat(n=1000), 400, "invalid_request", "n"),
    ("huge max_tokens", "completions", comp(max_tokens=10**9), 400, "invalid_request", "max_tokens"),
    (
        "too many top_logprobs",
        "chat",
        chat(logprobs=True, top_logprobs=50),
        400,
        "invalid_request",
        "top_logprobs",
    ),
    ("min_tokens over max_tokens", "completions", comp(min_tokens=5), 400, "invalid_request", "min_tokens"),
    ("echo of a wrong type", "completions", comp(echo="yes"), 400, "invalid_request", "echo"),
    (
        "prompt beyond the context",
        "completions",
        comp(prompt=[5] * 2040, max_tokens=10),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("invalid JSON", "chat", b'{"messages": [', 400, "invalid_json", None),
    ("not an object", "chat", b"[1, 2]", 400, "invalid_request", None),
    ("unknown model", "chat", chat(model="gpt-9"), 404, "model_not_found", "model"),
    ("oversize body", "completions", comp(prompt="word " * 4000), 413, "body_too_large", None),
]


def url_path(path: str) -> str:
    return "chat/completions" if path == "chat" else "completions"


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param, err


def assert_good_request_works(srv: Any) -> None:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=chat(), headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "code", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_then_good_input(
    srv: Any, case: str, path: str, body: Any, status: int, code: str, param: str | None
) -> None:
    r = httpx.post(
        f"{srv.base_url}/v1/{url_path(path)}",
        headers={"content-type": "application/json", **AUTH},
        content=body if isinstance(body, bytes) else orjson.dumps(body),
        timeout=30,
    )
    assert_error(r, status, code, param)
    assert_good_request_works(srv)


def test_streamed_bad_input_is_a_plain_error(srv: Any) -> None:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=chat(stream=True, n=99), headers=AUTH)
    assert_error(r, 400, "invalid_request", "n")


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY}],
    ids=["missing", "wrong", "not bearer"],
)
@pytest.mark.parametrize(
    "route",
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/metrics",
        "/ready",
        "/tokenize",
        "/detokenize",
    ],
)
def test_api_key_is_required(srv: Any, route: str, headers: dict[str, str]) -> None:
    method = "POST" if route.endswith(("completions", "tokenize")) else "GET"
    bodies = {"/detokenize": {"tokens": [1, 2]}, "/tokenize": {"prompt": "hello"}}
    body = chat() if "chat" in route else bodies.get(route) or comp()
    assert_error(
        httpx.request(method, f"{srv.base_url}{route}", json=body, headers=headers), 401, "invalid_api_key"
    )
    assert httpx.request(method, f"{srv.base_url}{route}", json=body, headers=AUTH).status_code == 200


def test_health_and_ui_need_no_key(srv: Any) -> None:
    assert httpx.get(f"{srv.base_url}/health").status_code == 200
    r = httpx.get(f"{srv.base_url}/")
    assert r.status_code == 200 and "<html" in r.text.lower()


def test_unknown_route_is_an_openai_error(srv: Any) -> None:
    assert_error(httpx.get(f"{srv.base_url}/v1/nothing", headers=AUTH), 404, "not_found")


def test_ws_validation_matches_http(srv: Any) -> None:
    """The same checks on the socket: an error per message, the socket stays open."""

    async def run() -> tuple[list[dict[str, Any]], int | None]:
        url = f"{srv.ws_url}?api_key={KEY}"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.recv()  # hello
            bad = [
                {"type": "chat", "id": "a", "messages": [{"role": "wizard", "content": "x"}]},
                {"type": "chat", "id": "b", "messages": MSGS, "temperature": "hot"},
                {"type": "completion", "id": "c", "prompt": "x", "n": 1000},
                {"type": "completion", "id": "d", "prompt": ""},
                {"type": "completion", "id": "e", "prompt": "x", "stop": ["1", "2", "3", "4"]},
            ]
            for m in bad:
                await ws.send(orjson.dumps(m).decode())
            await ws.send('{"type": "chat", "id": "f", "messages": [], "max_tokens": NaN}')
            got = [orjson.loads(await ws.recv()) for _ in range(len(bad) + 1)]
            await ws.send(
                orjson.dumps({"type": "completion", "id": "ok", "prompt": "x", "max_tokens": 2}).decode()
            )
            while (m := orjson.loads(await ws.recv()))["type"] != "done":
                pass
            got.append(m)
            await ws.send("x" * 5000)  # over max_ws_message_bytes
            try:
                await ws.recv()
            except websockets.ConnectionClosed as e:
                return got, e.rcvd.code if e.rcvd else None
            return got, None

    got, close_code = asyncio.run(run())
    assert [(m["id"], m["code"], m["param"]) for m in got[:-1]] == [
        ("a", "invalid_request", "messages.0.role"),
        ("b", "invalid_request", "temperature"),
        ("c", "invalid_request", "n"),
        ("d", "invalid_request", "prompt"),
        ("e", "invalid_request", "stop"),
        (None, "invalid_json", None),  # not JSON: the server can't know the id
    ]
    assert got[-1]["id"] == "ok" and got[-1]["type"] == "done"
    assert close_code == 1009


def test_errors_are_counted(srv: Any) -> None:
    before = srv.metric("wsllm_request_errors_total", code="invalid_request")
    httpx.post(f"{srv.base_url}/v1/chat/completions", json=chat(n=99), headers=AUTH)
    assert srv.metric("wsllm_request_errors_total", code="invalid_request") - before == 1
