"""Issue 12 on the Redis deployment: an engine worker (here, on the tiny model) and two
gateways: A in this process (its router can be inspected), B a `wsllm gateway` child
process (its memory can be measured).

- malformed entries written straight into the request and abort streams land in the
  dead-letter stream with a reason, and the engine keeps serving (acceptance 2);
- nobody without a stream's resume token can resume, read or cancel it, over the
  WebSocket or `GET /v1/streams/{id}`, on the same gateway or the other (acceptance 3);
- a client that never reads leaves the gateway's memory bounded and is dropped after
  --send-timeout-s, its KV blocks freed (acceptance 4);
- a Last-Event-ID that is not ASCII digits is refused before anything starts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets
from rawclients import ws_connect, ws_send
from redis_fixtures import Cluster, Result, read_sse, ws_messages, ws_url

from wsllm.broker.redis import RedisBroker
from wsllm.config import GatewayConfig, RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.server.app import create_app

GRACE_S = 1.0
B_FLAGS = ["--send-timeout-s", "2", "--heartbeat-s", "60", "--max-buffered-events", "1024"]


@dataclass
class Deployment:
    a: str  # gateway A's base URL (in this process)
    b: str  # gateway B's base URL (a child process)
    app_a: Any
    worker: EngineWorker
    engine: Any
    cluster: Cluster
    model: str

    @property
    def redis(self) -> Any:
        return self.cluster.redis()

    def gateway_b_rss(self) -> int:
        (proc,) = self.cluster.gateways.values()
        for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def engine_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished():
            assert time.monotonic() < deadline, f"the engine still runs requests: {self.engine.stats()}"
            time.sleep(0.05)
        s = self.engine.stats()
        assert s.num_free_blocks == s.num_total_blocks, s


@pytest.fixture(scope="module")
def dep(
    redis_server: Any, tiny_engine: Any, tiny_model_dir: Path, uvicorn_thread: Any, tmp_path_factory: Any
) -> Iterator[Deployment]:
    redis_server.client().flushall()
    model = tiny_model_dir.name
    assert tiny_engine.model_name == model
    rcfg = RedisConfig(resume_grace_s=GRACE_S, stream_retention_s=30, engine_ttl_s=5)
    engine_side = RedisBroker(redis_server.url, model=model, cfg=rcfg, engine_id="engine-h")
    worker = EngineWorker(tiny_engine, engine_side, engine_id="engine-h", heartbeat_s=0.2)
    worker.start()
    gateway_a = RedisBroker(redis_server.url, model=model, cfg=rcfg)
    cluster = Cluster(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("hardening-logs"))
    try:
        cluster.start_gateway(*B_FLAGS)
        app_for = lambda c: create_app(c, gateway_a, tiny_model_dir, model)  # noqa: E731
        with uvicorn_thread(app_for, GatewayConfig(frontend=False)) as (a, app):
            cluster.wait_ready(1)
            yield Deployment(a, cluster.urls[0], app, worker, tiny_engine, cluster, model)
    finally:
        cluster.stop()
        worker.stop()
        gateway_a.close()
        engine_side.close()


def body(prompt: list[int], n_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True} | kw


async def sse_text(base: str, b: dict[str, Any]) -> Result:
    res = Result()
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream("POST", f"{base}/v1/completions", json=b | {"stream": True}) as r,
    ):
        assert r.status_code == 200
        await read_sse(r, res)
    return res


# -- acceptance 2 -----------------------------------------------------------------------------


def test_malformed_entries_go_to_the_dead_letters_and_the_engine_serves_on(dep: Deployment) -> None:
    r = dep.redis
    queue, aborts, dead = f"wsllm:q:{dep.model}", "wsllm:aborts", f"wsllm:dead:{dep.model}"
    good = body([31, 32, 33], 150)
    (alone,) = [asyncio.run(sse_text(dep.a, good))]
    valid = orjson.loads(r.xrange(queue)[0][1][b"r"]) if r.xlen(queue) else None
    template = valid or {
        "v": 1,
        "kind": "request",
        "item": {"request_id": "x", "prompt_token_ids": [1], "params": {}},
    }

    def with_item(**change: Any) -> bytes:
        msg = orjson.loads(orjson.dumps(template))
        msg["item"] |= change
        return orjson.dumps(msg)

    bad_requests = [
        {"r": with_item(request_id="bad-1", prompt_token_ids=5)},
        {"r": with_item(request_id="bad-2", arrival_time="x")},
        {"r": with_item(request_id="bad-3", params={"top_k": 2**64 - 1})},
        {"r": b"\xff not json"},
        {"nothing": b"here"},
    ]
    bad_aborts: list[dict[str, bytes]] = [{"x": b"1"}, {"r": b"\xff\xfe"}, {"r": b"a" * 1000}]
    steps = dep.worker.steps
    thread = dep.worker._thread

    async def go() -> Result:
        task = asyncio.create_task(sse_text(dep.a, good))
        await asyncio.sleep(0.3)  # it streams now
        for fields in bad_requests:
            r.xadd(queue, fields)
        for fields in bad_aborts:
            r.xadd(aborts, fields)
        return await task

    res = asyncio.run(go())
    assert res.finish_reason == "length" and res.text == alone.text
    deadline = time.monotonic() + 10
    while r.xlen(dead) < len(bad_requests) + len(bad_aborts):
        assert time.monotonic() < deadline, r.xrange(dead)
        time.sleep(0.05)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(dead)]
    assert sum(x.startswith("invalid request entry") for x in reasons) == len(bad_requests), reasons
    assert sum(x.startswith("invalid abort entry") for x in reasons) == len(bad_aborts), reasons
    assert any("prompt_token_ids" in x for x in reasons) and any("top_k" in x for x in reasons)
    assert any("arrival_time" in x for x in reasons)
    # the same engine, still stepping, serves the next request
    assert dep.worker._thread is thread and thread.is_alive() and dep.worker.steps > steps
    assert asyncio.run(sse_text(dep.b, body([1, 2], 5))).finish_reason == "length"
    assert r.xlen(queue) == 0
    dep.engine_idle()


# -- acceptance 3 -----------------------------------------------------------------------------


async def ws_send_and_wait(url: str, msg: dict[str, Any], until: str = "error") -> dict[str, Any]:
    async with websockets.connect(url) as ws:
        await ws.recv()
        await ws.send(orjson.dumps(msg).decode())
        return (await ws_messages(ws, lambda m: m["type"] in (until, "error")))[-1]


def test_nobody_without_the_token_can_resume_read_or_cancel_a_stream(dep: Deployment) -> None:
    msg = {"type": "completion", "id": "a1"} | body([41, 42], 120)
    whole = asyncio.run(sse_text(dep.a, body([41, 42], 120))).text

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


def test_the_owner_reads_its_sse_stream_again_with_its_token_only(dep: Deployment) -> None:
    b = body([51, 52], 60)

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


# -- item 6 -----------------------------------------------------------------------------------


def test_a_non_ascii_last_event_id_is_refused_before_anything_starts(dep: Deployment) -> None:
    gw = dep.app_a.state.gateway

    async def go() -> tuple[str, httpx.Response]:
        first = Result()
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", f"{dep.a}/v1/completions", json=body([61, 62], 2000) | {"stream": True}) as r,
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
    deadline = time.monotonic() + GRACE_S + 10
    while dep.engine.is_known(rid) or rid in gw.router.request_ids():
        assert time.monotonic() < deadline, "the cut stream was never aborted"
        time.sleep(0.05)
    dep.engine_idle()


# -- acceptance 4 -----------------------------------------------------------------------------


def test_a_client_that_never_reads_leaves_the_gateway_memory_bounded(dep: Deployment) -> None:
    asyncio.run(sse_text(dep.b, body([1, 2], 20, logprobs=20, n=8)))  # warm: code paths, caches
    before = dep.gateway_b_rss()
    timeouts = metric(dep.b, "wsllm_send_timeouts_total", 'transport="ws"')
    sock = ws_connect(dep.b)
    most = before
    try:
        for i in range(8):  # 8 requests x 8 choices x 2000 tokens, 20 logprobs each: ~300 MB of events
            ws_send(
                sock, {"type": "completion", "id": f"slow{i}"} | body([70 + i, 1], 2000, n=8, logprobs=20)
            )
        deadline = time.monotonic() + 120
        while metric(dep.b, "wsllm_send_timeouts_total", 'transport="ws"') == timeouts:
            most = max(most, dep.gateway_b_rss())
            assert time.monotonic() < deadline, "the client that never reads was never dropped"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    grew = most - before
    print(
        f"gateway RSS: {before / 2**20:.0f} MiB before, at most {most / 2**20:.0f} MiB with the slow client"
    )
    assert grew < 96 * 2**20, f"the gateway grew by {grew / 2**20:.0f} MiB"
    dep.engine_idle()  # its requests were cancelled: every KV block is free


def metric(base: str, name: str, label: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
