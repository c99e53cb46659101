"""A stream belongs to the client that started it, on the Redis deployment (the
`redis_deployment` fixture: gateway A in this process, gateway B a child process):
nobody without its resume token can resume, read or cancel it, over the WebSocket or
`GET /v1/streams/{id}`, on the same gateway or the other; its owner reads it again
with the token; a Last-Event-ID that is not ASCII digits is refused before anything
starts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import websockets
from bodies import completion
from redis_fixtures import Deployment, Result, read_sse, sse_text, ws_messages, ws_url


async def ws_send_and_wait(url: str, msg: dict[str, Any], until: str = "error") -> dict[str, Any]:
    async with websockets.connect(url) as ws:
        await ws.recv()
        await ws.send(orjson.dumps(msg).decode())
        return (await ws_messages(ws, lambda m: m["type"] in (until, "error")))[-1]


def test_nobody_without_the_token_can_resume_read_or_cancel_a_stream(redis_deployment: Deployment) -> None:
    dep = redis_deployment
    msg = {"type": "completion", "id": "a1"} | completion([41, 42], 120)
    whole = asyncio.run(sse_text(dep.a, completion([41, 42], 120))).text

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[httpx.Response]]:
        refused: list[dict[str, Any]] = []
        answers: list[httpx.Response] = []
        async with websockets.connect(ws_url(dep.a)) as owner:
            await owner.recv()
            await owner.send(orjson.dumps(msg).decode())
            mine = await ws_messages(owner, lambda m: m["type"] == "delta")
            started = mine[0]
            rid, token = started["request_id"], started["resume_token"]
            assert rid in token
            forged = [None, "", f"{rid}.not-the-secret", "a1", f"{rid}.{token.rsplit('.', 1)[1][:-1]}x"]
            for gw in (dep.a, dep.b):  # the same gateway, and another one
                for t in forged:
                    resume = {"type": "resume", "id": "a1", "after_seq": -1}
                    refused.append(
                        await ws_send_and_wait(
                            ws_url(gw), resume | ({"resume_token": t} if t is not None else {})
                        )
                    )
                refused.append(await ws_send_and_wait(ws_url(gw), {"type": "cancel", "id": "a1"}))
                async with httpx.AsyncClient(timeout=30) as http:
                    for t in forged:
                        headers = {"x-resume-token": t} if t else {}
                        answers.append(await http.get(f"{gw}/v1/streams/{rid}", headers=headers))
            mine += await ws_messages(owner, lambda m: m["type"] in ("done", "error"))
        return mine, refused, answers

    mine, refused, answers = asyncio.run(go())
    # the owner's stream went on, whole and undisturbed
    assert mine[-1]["type"] == "done" and mine[-1]["finish_reason"] == "length", mine[-1]
    assert "".join(m["text"] for m in mine if m["type"] == "delta") == whole
    assert all(m["type"] == "error" and m["code"] in ("invalid_request", "unknown_id") for m in refused), (
        refused
    )
    assert all(a.status_code in (400, 404) for a in answers), [a.text for a in answers]
    assert not any(a.headers.get("content-type", "").startswith("text/event-stream") for a in answers)


def test_the_owner_reads_its_sse_stream_again_with_its_token_only(redis_deployment: Deployment) -> None:
    dep = redis_deployment
    b = completion([51, 52], 60)

    async def go() -> tuple[Result, httpx.Response, Result]:
        first = Result()
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", f"{dep.a}/v1/completions", json=b | {"stream": True}) as r,
        ):
            token = r.headers["x-resume-token"]
            await read_sse(r, first, stop_after=3)
        async with httpx.AsyncClient(timeout=60) as http:
            other = await http.get(
                f"{dep.b}/v1/streams/{first.request_id}", headers={"x-resume-token": token + "x"}
            )
            rest = Result()
            headers = {"last-event-id": str(first.last_event_id), "x-resume-token": token}
            async with http.stream("GET", f"{dep.b}/v1/streams/{first.request_id}", headers=headers) as r:
                assert r.status_code == 200
                await read_sse(r, rest)
        return first, other, rest

    first, other, rest = asyncio.run(go())
    assert other.status_code == 404 and other.json()["error"]["code"] == "unknown_id"
    assert first.text + rest.text == asyncio.run(sse_text(dep.a, b)).text and rest.finish_reason == "length"


def test_a_non_ascii_last_event_id_is_refused_before_anything_starts(redis_deployment: Deployment) -> None:
    dep = redis_deployment
    gw = dep.app_a.state.gateway

    async def go() -> tuple[str, httpx.Response]:
        first = Result()
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream(
                "POST", f"{dep.a}/v1/completions", json=completion([61, 62], 2000) | {"stream": True}
            ) as r,
        ):
            token = r.headers["x-resume-token"]
            await read_sse(r, first, stop_after=2)
            bad = await http.get(
                f"{dep.a}/v1/streams/{first.request_id}",
                headers={"last-event-id": "²".encode(), "x-resume-token": token},
            )
        return str(first.request_id), bad

    rid, bad = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    # Nothing started: the stream is followed by nobody, and its grace abort still ends it.
    deadline = time.monotonic() + dep.grace_s + 10
    while dep.engine.is_known(rid) or rid in gw.router.request_ids():
        assert time.monotonic() < deadline, "the cut stream was never aborted"
        time.sleep(0.05)
    dep.engine_idle()


def test_a_stream_whose_client_took_the_whole_answer_leaves_no_key(redis_deployment: Deployment) -> None:
    """Its done event delivered, nobody will resume it: its keys go at once (the retention,
    30 s here, is for a client that did not get it all), over SSE, a whole answer and the
    WebSocket, on either gateway."""
    from wsllm.broker.redis_keys import Keys

    dep = redis_deployment
    keys, r = Keys("wsllm"), dep.redis

    async def go() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for gw in (dep.a, dep.b):
            async with httpx.AsyncClient(timeout=60) as http:
                streamed = Result()
                async with http.stream(
                    "POST", f"{gw}/v1/completions", json=completion([71], 8) | {"stream": True}
                ) as s:
                    token = s.headers["x-resume-token"]
                    await read_sse(s, streamed)
                out.append((str(streamed.request_id), token))
                whole = await http.post(f"{gw}/v1/completions", json=completion([72], 8))
                out.append((whole.json()["id"], ""))  # a whole answer has no resume token
            async with websockets.connect(ws_url(gw)) as ws:
                await ws.recv()
                await ws.send(orjson.dumps({"type": "completion", "id": "w"} | completion([73], 8)).decode())
                msgs = await ws_messages(ws, lambda m: m["type"] in ("done", "error"))
                assert msgs[-1]["type"] == "done", msgs[-1]
                out.append((msgs[0]["request_id"], msgs[0]["resume_token"]))
        return out

    done = asyncio.run(go())
    for rid, token in done:
        deadline = time.monotonic() + 5  # the transport's close, just after the done event
        while r.exists(keys.out(dep.model, rid)):
            assert time.monotonic() < deadline, f"{rid}'s stream outlived its whole answer"
            time.sleep(0.05)
        if token:
            again = httpx.get(f"{dep.a}/v1/streams/{rid}", headers={"x-resume-token": token}, timeout=30)
            assert again.status_code == 404, again.text
