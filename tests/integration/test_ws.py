"""The WebSocket API with a real `websockets` client: many requests on one socket,
cancel, close, ping, errors that keep the socket open, Origin and API key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

KEY = "ws-secret"


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, api_key=KEY, max_requests_per_socket=9, max_ws_message_bytes=8192) as s:
        yield s


def connect(srv: Any, **kw: Any) -> Any:
    kw.setdefault("additional_headers", {"authorization": f"Bearer {KEY}"})
    kw.setdefault("close_timeout", 1)  # a socket left mid-stream: not websockets' 10 s for the reply
    return websockets.connect(srv.ws_url, **kw)


async def send(ws: Any, **msg: Any) -> None:
    await ws.send(orjson.dumps(msg).decode())


async def recv(ws: Any, timeout: float = 30.0) -> dict[str, Any]:
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))  # type: ignore[no-any-return]


async def hello(ws: Any) -> dict[str, Any]:
    msg = await recv(ws)
    assert msg["type"] == "hello"
    return msg


def completion(mid: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "completion",
        "id": mid,
        "prompt": [11, 22, 33],
        "temperature": 0,
        "ignore_eos": True,
    } | kw


def test_eight_requests_on_one_socket_one_cancelled(srv: Any) -> None:
    aborted_before = srv.metric("wsllm_request_aborts_total")

    async def run() -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
        async with connect(srv) as ws:
            h = await hello(ws)
            assert h["model"] == srv.gateway.model_name and h["limits"]["max_requests_per_socket"] == 9
            for i in range(8):  # "c" runs long so that it is surely mid-stream when cancelled
                n = 2000 if i == 3 else 16
                await send(
                    ws, **completion("c" if i == 3 else f"r{i}", max_tokens=n, prompt=[11 + i, 22, 33])
                )
            by_id: dict[str, list[dict[str, Any]]] = {}
            cancelled, done = False, 0
            while done < 8:
                m = await recv(ws)
                by_id.setdefault(m["id"], []).append(m)
                if m["id"] == "c" and m["type"] == "delta" and not cancelled:
                    await send(ws, type="cancel", id="c")
                    cancelled = True
                if m["type"] == "done":
                    done += 1
                if m["id"] == "c" and m["type"] == "done":
                    # The gateway answered: the abort is with the broker. One step later
                    # the engine must have let the request and its blocks go.
                    srv.assert_engine_forgot(m["request_id"])
            return by_id["c"][-1], by_id

    c_done, by_id = asyncio.run(run())
    assert c_done["type"] == "done" and c_done["finish_reason"] == "abort"
    assert 0 < c_done["usage"]["completion_tokens"] < 2000
    for i in [0, 1, 2, 4, 5, 6, 7]:
        msgs = by_id[f"r{i}"]
        deltas = [m for m in msgs if m["type"] == "delta"]
        assert [m["seq"] for m in deltas] == list(range(len(deltas)))
        assert msgs[-1]["type"] == "done" and msgs[-1]["finish_reason"] == "length"
        assert msgs[-1]["usage"]["completion_tokens"] == 16
    assert srv.metric("wsllm_request_aborts_total") - aborted_before == 1
    srv.assert_no_blocks_held()


def test_request_ids_say_chat_or_completion_as_openai_ids_do(srv: Any) -> None:
    """A chat's request id starts `chatcmpl-` and a completion's `cmpl-`, as on the
    HTTP routes (and in the answers OpenAI gives)."""

    async def run() -> dict[str, str]:
        async with connect(srv) as ws:
            await hello(ws)
            chat = {"type": "chat", "id": "a", "messages": [{"role": "user", "content": "hi"}]}
            await send(ws, **chat, max_tokens=2)
            await send(ws, **completion("b", max_tokens=2))
            ids, done = {}, 0
            while done < 2:
                m = await recv(ws)
                if m["type"] == "started":
                    ids[m["id"]] = m["request_id"]
                done += m["type"] == "done"
            return ids

    ids = asyncio.run(run())
    assert ids["a"].startswith("chatcmpl-") and ids["b"].startswith("cmpl-"), ids


def test_closing_the_socket_aborts_its_requests(srv: Any) -> None:
    async def run() -> list[str]:
        async with connect(srv) as ws:
            await hello(ws)
            await send(ws, **completion("a", max_tokens=2000))
            await send(ws, **completion("b", max_tokens=2000, prompt=[5, 6]))
            while (await recv(ws))["type"] != "delta":
                pass
            return srv.gateway.router.request_ids()

    rids = asyncio.run(run())  # leaving the block closes the socket mid-stream
    assert len(rids) == 2
    for rid in rids:
        srv.assert_engine_forgot(rid)
    srv.assert_no_blocks_held()


def test_errors_keep_the_socket_open(srv: Any) -> None:
    async def run() -> list[dict[str, Any]]:
        async with connect(srv) as ws:
            await hello(ws)
            await ws.send("{not json")
            await send(ws, type="chat", id="x", messages=[])
            await send(ws, type="warp", id="y")
            await send(ws, type="cancel", id="nobody")
            await send(ws, type="resume", id="old", after_seq=3, resume_token="cmpl-1.secret")
            await send(ws, **completion("d", max_tokens=2000))
            await send(ws, **completion("d", max_tokens=2))
            await send(ws, type="ping")
            got = [await recv(ws) for _ in range(8)]  # 6 errors, pong, and `started` for "d"
            await send(ws, type="cancel", id="d")
            while (m := await recv(ws))["type"] != "done":
                pass
            await send(ws, **completion("ok", max_tokens=3))
            while (m := await recv(ws))["type"] != "done":
                pass
            return [*got, m]

    msgs = asyncio.run(run())
    errors = [(m.get("id"), m.get("code")) for m in msgs if m["type"] == "error"]
    assert errors == [
        (None, "invalid_json"),
        ("x", "invalid_request"),
        ("y", "invalid_request"),
        ("nobody", "unknown_id"),
        ("old", "unknown_id"),  # the memory broker can't resume: the request ended with its socket
        ("d", "duplicate_id"),
    ]
    assert {"type": "pong"} in msgs
    assert msgs[-1]["id"] == "ok" and msgs[-1]["finish_reason"] == "length"


def test_oversize_frame_closes_with_1009(srv: Any) -> None:
    async def run() -> int | None:
        async with connect(srv, max_size=None) as ws:
            await hello(ws)
            await send(ws, **completion("big", prompt="x" * 9000))
            with pytest.raises(ConnectionClosed) as e:
                await recv(ws)
            assert e.value.rcvd is not None
            return e.value.rcvd.code

    assert asyncio.run(run()) == 1009


def test_api_key_on_the_handshake(srv: Any) -> None:
    async def status(**kw: Any) -> int:
        try:
            async with connect(srv, **kw) as ws:
                await hello(ws)
                return 101
        except InvalidStatus as e:
            return int(e.response.status_code)

    assert asyncio.run(status(additional_headers={})) == 403
    assert asyncio.run(status(additional_headers={"authorization": "Bearer nope"})) == 403
    srv_url = srv.ws_url
    try:
        srv.ws_url = f"{srv_url}?api_key={KEY}"  # browsers can't set headers on a WebSocket
        assert asyncio.run(status(additional_headers={})) == 101
    finally:
        srv.ws_url = srv_url


def test_origin_allowlist_defaults_to_same_origin(srv: Any) -> None:
    host = srv.base_url.removeprefix("http://")

    async def status(origin: str) -> int:
        try:
            async with connect(srv, origin=origin) as ws:
                await hello(ws)
                return 101
        except InvalidStatus as e:
            return int(e.response.status_code)

    assert asyncio.run(status(f"http://{host}")) == 101
    assert asyncio.run(status("http://evil.example")) == 403
    srv.gateway.cfg.allowed_origins = "http://app.example, http://other.example"
    try:
        assert asyncio.run(status("http://app.example")) == 101
        assert asyncio.run(status(f"http://{host}")) == 403
    finally:
        srv.gateway.cfg.allowed_origins = ""
