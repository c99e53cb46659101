"""Admission comes first on every route and every WebSocket message kind: a key past
its rpm gets 429, in its API's own error shape, and the gateway did nothing for it: no
template rendered, no text tokenized or detokenized, no grammar compiled, no stored
conversation read (the real tokenizer's, the compiler's and the response store's calls
are counted). A socket whose cap is one request refuses a second request of any kind
while one runs; a text longer than the context can hold is refused by its length, untokenized
(tiny model, memory broker)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets

from wsllm.broker.response_store import MemoryResponseStore
from wsllm.server import prepare

KEYS = """
[tenants.spent]
keys = ["sk-spent"]
rpm = 1

[tenants.onesocket]
keys = ["sk-onesocket"]
rpm = 1
"""
ADMIN = "sk-admin"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
MESSAGES = [{"role": "user", "content": "Name a city in the north. " * 20}]
TEXT = "a text the gateway would tokenize " * 30
# Every route, with a body it would template, tokenize, compile or look up once admitted.
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        },
    ),
    "completions": (
        "/v1/completions",
        {"prompt": [TEXT, TEXT], "max_tokens": 4, "structured_outputs": {"regex": "[a-z]+"}},
    ),
    "responses": (
        "/v1/responses",
        {"input": TEXT, "previous_response_id": "resp_0123", "max_output_tokens": 4},
    ),
    "messages": ("/v1/messages", {"model": "", "max_tokens": 4, "messages": MESSAGES}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": "", "messages": MESSAGES}),
    "embeddings": ("/v1/embeddings", {"input": [TEXT] * 4}),
    "tokenize": ("/tokenize", {"messages": MESSAGES}),
    "detokenize": ("/detokenize", {"tokens": list(range(1, 200))}),
}
# Every WebSocket message kind that starts a request, with the same work behind it.
WS_KINDS: dict[str, dict[str, Any]] = {
    "chat": {"type": "chat", "messages": MESSAGES, "max_tokens": 4},
    "completion": {"type": "completion", "prompt": TEXT, "max_tokens": 4},
    "responses": {"type": "responses", "input": TEXT, "previous_response_id": "resp_0123"},
    "embeddings": {"type": "embeddings", "input": [TEXT] * 4},
}


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with live_server(tiny_engine, api_keys_file=str(path), api_key=ADMIN, max_requests_per_socket=1) as s:
        yield s


@pytest.fixture
def work(srv: Any, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The gateway's work, counted: each call of the model's tokenizer (its template
    too), each grammar compile, each read of a stored response."""
    calls: Counter[str] = Counter()
    codec = srv.gateway.models.default.codec

    def counting(name: str, real: Any) -> Any:
        def counted(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return real(*args, **kw)

        return counted

    for name in ("encode", "encode_text", "encode_chat", "render_chat", "decode", "token_strs"):
        monkeypatch.setattr(codec, name, counting(name, getattr(codec, name)))
    monkeypatch.setattr(prepare, "checked", counting("compile", prepare.checked))
    monkeypatch.setattr(MemoryResponseStore, "get", counting("history", MemoryResponseStore.get))
    return calls


def post(srv: Any, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    body = body | ({"model": srv.gateway.model_name} if "model" in body else {})
    return httpx.post(
        f"{srv.base_url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def spend(srv: Any) -> None:
    """Until the spent tenant's one request a minute is taken (the bucket refills slowly)."""
    for _ in range(3):
        if post(srv, "sk-spent", "/detokenize", {"tokens": [5]}).status_code == 429:
            return
    raise AssertionError("the tenant's rpm never ran out")


def test_the_routes_do_their_work_once_admitted(srv: Any, work: Counter[str]) -> None:
    """The counters see the work these bodies make (so that a zero below means none)."""
    for name, (path, body) in ROUTES.items():
        before = sum(work.values())
        r = post(srv, ADMIN, path, body)
        assert r.status_code in (200, 404), (name, r.text)  # responses: its previous one is not stored
        assert sum(work.values()) > before, name
    assert work["compile"] >= 2 and work["encode_chat"] >= 4 and work["history"] == 1


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_a_route_past_the_rpm_is_429_before_any_work(srv: Any, work: Counter[str], name: str) -> None:
    path, body = ROUTES[name]
    spend(srv)
    seen = dict(work)
    r = post(srv, "sk-spent", path, body)
    assert r.status_code == 429, r.text
    if name in ("messages", "count_tokens"):  # Anthropic's shape on its routes
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
    else:
        assert r.json()["error"]["code"] == "rate_limited"
    assert int(r.headers["retry-after"]) >= 1
    assert dict(work) == seen, f"{name}: work done for a refused request"


async def _exchange(srv: Any, key: str, *msgs: dict[str, Any], until: int) -> list[dict[str, Any]]:
    """Send `msgs` on one socket; the messages received until `until` errors came."""
    out: list[dict[str, Any]] = []
    url, headers = srv.ws_url, {"authorization": f"Bearer {key}"}
    async with websockets.connect(url, additional_headers=headers, close_timeout=1) as ws:
        assert orjson.loads(await ws.recv())["type"] == "hello"
        for m in msgs:
            await ws.send(orjson.dumps(m).decode())
        while sum(m["type"] == "error" for m in out) < until:
            out.append(orjson.loads(await asyncio.wait_for(ws.recv(), 60)))
        with contextlib.suppress(Exception):
            await ws.send(orjson.dumps({"type": "cancel", "id": "long"}).decode())
    return out


def test_a_websocket_message_past_the_rpm_is_429_before_any_work(srv: Any, work: Counter[str]) -> None:
    """The handshake took the tenant's one request of the minute: every message after
    it is refused, before any work (a spent key's handshake is refused itself:
    test_admission_order.py)."""
    seen = dict(work)
    msgs = [kind | {"id": name} for name, kind in WS_KINDS.items()]
    got = asyncio.run(_exchange(srv, "sk-onesocket", *msgs, until=len(msgs)))
    errors = {m["id"]: m for m in got if m["type"] == "error"}
    assert set(errors) == set(WS_KINDS), got
    assert all(e["code"] == "rate_limited" and e["retry_after_s"] >= 1 for e in errors.values())
    assert dict(work) == seen, "work done for a refused request"


@pytest.mark.parametrize("first", ["chat", "responses"])
def test_a_socket_capped_at_one_request_refuses_a_second_of_any_kind(srv: Any, first: str) -> None:
    long = {
        "chat": {"type": "chat", "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True},
        "responses": {"type": "responses", "input": TEXT, "max_output_tokens": 1000},
    }[first] | {"id": "long"}
    others = [kind | {"id": name} for name, kind in WS_KINDS.items()]
    others.append({"type": "resume", "id": "resume", "after_seq": -1, "resume_token": "x.y"})
    got = asyncio.run(_exchange(srv, ADMIN, long, *others, until=len(others)))
    errors = {m["id"]: m["code"] for m in got if m["type"] == "error"}
    assert errors == dict.fromkeys([*WS_KINDS, "resume"], "too_many_requests"), got
    assert any(m["type"] == "started" and m["id"] == "long" for m in got)
    srv.wait_gateway_forgot()
    srv.assert_no_blocks_held()


@pytest.mark.parametrize(("path", "field"), [("/v1/embeddings", "input"), ("/v1/completions", "prompt")])
def test_a_text_the_context_cannot_hold_is_refused_by_its_length_before_tokenizing(
    srv: Any, work: Counter[str], path: str, field: str
) -> None:
    """Past the context times the vocabulary's longest token, a text is too long
    whatever its tokens: a 400 without tokenizing it (a megabyte takes a second)."""
    (card,) = httpx.get(f"{srv.base_url}/v1/models", headers={"authorization": f"Bearer {ADMIN}"}).json()[
        "data"
    ]
    most = card["max_model_len"] * srv.gateway.models.default.codec.max_token_chars
    seen = dict(work)
    r = post(srv, ADMIN, path, {field: "x" * (most + 1)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == field
    assert dict(work) == seen, "the text was tokenized"
