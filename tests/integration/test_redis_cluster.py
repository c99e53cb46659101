"""The Redis deployment as users run it: `wsllm gateway` and `wsllm engine` child
processes on a real redis-server, with a tiny random model and a 2 s lease.

The tests share one cluster (two gateways, two engines) and run in file order: the
crash tests replace the engine they stop, and the Redis restart comes last."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets
from redis_fixtures import (
    LEASE_S,
    Cluster,
    Result,
    joined,
    on_one_and_on_a_cluster,  # noqa: F401 - every test runs on both
    read_sse,
    sse_completion,
    ws_messages,
    ws_run,
    ws_url,
)

from wsllm.broker.redis_conn import is_cluster
from wsllm.broker.redis_keys import Keys

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)  # the soak's Redis INFO and the crash timings go in the test log

PROMPTS = ["The river", "Once upon a time", "In a quiet village", "Numbers: 1, 2, 3"]


@pytest.fixture(scope="module")
def cluster(
    redis_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    redis_server.client().flushall()
    c = Cluster(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("cluster-logs"))
    log.info("cluster logs: %s", c.logs)
    try:
        c.start(gateways=2, engines=2)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


def body(prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | kw


async def references(base: str, bodies: list[dict[str, Any]]) -> list[str]:
    """Uninterrupted runs: what the answers must be."""
    async with httpx.AsyncClient(timeout=60) as http:
        rs = await asyncio.gather(*(sse_completion(http, base, b) for b in bodies))
    return [r.text for r in rs]


def test_two_gateways_two_engines_serve_40_concurrent_streams(cluster: Cluster) -> None:
    steps_before = {e: s.get("num_steps", 0) for e, s in cluster.engine_stats().items()}

    async def go() -> list[Result]:
        async with httpx.AsyncClient(timeout=60) as http:
            jobs = [
                sse_completion(http, cluster.urls[i % 2], body(PROMPTS[i % 4], 24 + i % 8)) for i in range(40)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(go())
    for i, r in enumerate(results):
        assert r.error is None and r.finish_reason == "length" and r.text, (i, r)
    time.sleep(0.5)  # a heartbeat carries the final step counts
    steps_after = {e: s.get("num_steps", 0) for e, s in cluster.engine_stats().items()}
    assert len(steps_after) == 2
    assert all(steps_after[e] > steps_before.get(e, 0) for e in steps_after), (steps_before, steps_after)


def test_a_websocket_client_resumes_on_the_other_gateway(cluster: Cluster) -> None:
    gw1, gw2 = cluster.urls
    msg = {"type": "completion", "id": "resume-me", "prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0,
           "ignore_eos": True}  # fmt: skip
    whole = joined(asyncio.run(ws_run(gw1, msg | {"id": "uninterrupted"})))

    async def cut_and_resume() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with websockets.connect(ws_url(gw1)) as ws:
            await ws.recv()
            await ws.send(orjson.dumps(msg).decode())
            first = await ws_messages(ws, lambda m: m["type"] == "delta" and m["seq"] == 4)
        # the socket is gone mid-answer; a new one, on the other gateway process
        async with websockets.connect(ws_url(gw2)) as ws:
            await ws.recv()
            token = next(m["resume_token"] for m in first if m["type"] == "started")
            await ws.send(
                json.dumps({"type": "resume", "id": "resume-me", "after_seq": 4, "resume_token": token})
            )
            rest = await ws_messages(ws, lambda m: m["type"] in ("done", "error"))
        return first, rest

    first, rest = asyncio.run(cut_and_resume())
    deltas = [m for m in first + rest if m["type"] == "delta"]
    assert [m["seq"] for m in deltas] == list(range(len(deltas))), "a gap or a duplicate"
    assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "length"
    assert joined(first + rest) == whole


def test_a_resume_while_the_old_socket_still_closes_keeps_the_new_one(cluster: Cluster) -> None:
    """A client that reconnects to the same gateway before that gateway noticed its
    old socket went: the old one's clean-up must not cut the resumed stream."""
    gw1 = cluster.urls[0]
    msg = {"type": "completion", "id": "twice", "prompt": PROMPTS[3], "max_tokens": 60, "temperature": 0,
           "ignore_eos": True}  # fmt: skip

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        async with websockets.connect(ws_url(gw1)) as old:
            await old.recv()
            await old.send(orjson.dumps(msg).decode())
            first = await ws_messages(old, lambda m: m["type"] == "delta" and m["seq"] == 2)
            async with websockets.connect(ws_url(gw1)) as new:
                await new.recv()
                token = next(m["resume_token"] for m in first if m["type"] == "started")
                await new.send(
                    json.dumps({"type": "resume", "id": "twice", "after_seq": 2, "resume_token": token})
                )
                rest = [orjson.loads(await new.recv())]  # the resumed stream runs...
                await old.close()  # ...when the old socket's close reaches the gateway
                rest += await ws_messages(new, lambda m: m["type"] in ("done", "error"))
                # its client took the whole answer: the broker let it go, a resume finds nothing
                await new.send(
                    json.dumps({"type": "resume", "id": "again", "after_seq": -1, "resume_token": token})
                )
                again = await ws_messages(new, lambda m: m["type"] in ("done", "error"))
        return first, rest, again

    first, rest, again = asyncio.run(go())
    assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "length"
    deltas = [m for m in first + rest if m["type"] == "delta"]
    assert [m["seq"] for m in deltas] == list(range(len(deltas)))
    assert len(deltas) == 60  # each token once, none twice (a delta an event on a resumable broker)
    assert again[-1]["type"] == "error" and again[-1]["code"] == "unknown_id", again[-1]


def test_an_sse_client_resumes_on_the_other_gateway_with_last_event_id(cluster: Cluster) -> None:
    gw1, gw2 = cluster.urls
    b = body(PROMPTS[2], 40)
    (whole,) = asyncio.run(references(gw1, [b]))

    async def cut_and_resume() -> tuple[Result, Result]:
        first = Result()
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", f"{gw1}/v1/completions", json=b | {"stream": True}) as r,
        ):
            token = r.headers["x-resume-token"]
            await read_sse(r, first, stop_after=5)
        rest = Result()
        headers = {"last-event-id": str(first.last_event_id), "x-resume-token": token}
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("GET", f"{gw2}/v1/streams/{first.request_id}", headers=headers) as r,
        ):
            assert r.status_code == 200
            await read_sse(r, rest)
        return first, rest

    first, rest = asyncio.run(cut_and_resume())
    assert first.last_event_id == 5 and rest.finish_reason == "length"
    assert first.text + rest.text == whole
    r = httpx.get(f"{gw2}/v1/streams/cmpl-unknown", headers={"x-resume-token": "cmpl-unknown.secret"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_id"


async def _stream_all(cluster: Cluster, bodies: list[dict[str, Any]], on_started: Any) -> list[Result]:
    """Start all streams, call `on_started()` once they run, collect the results."""
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [
            asyncio.create_task(sse_completion(http, cluster.urls[i % 2], b)) for i, b in enumerate(bodies)
        ]
        await on_started()
        return await asyncio.gather(*tasks)


async def _busiest(cluster: Cluster, model: str) -> str:
    """Once the engines hold at least 3 requests: the engine holding the most."""
    deadline = time.monotonic() + 30
    while True:
        held = cluster.pending_by_engine(model)
        if sum(held.values()) >= 3:
            return max(held, key=lambda e: held[e])
        assert time.monotonic() < deadline, f"the engines took no work: {held}"
        await asyncio.sleep(0.05)


def _crash_bodies() -> list[dict[str, Any]]:
    # Long enough to be mid-stream at the kill, short enough to end soon after it.
    greedy = [body(p, 120) for p in PROMPTS] * 2
    seeded = [body(PROMPTS[0], 120, temperature=0.9, seed=11)] * 2
    sampled = [body(PROMPTS[1], 120, temperature=0.9)] * 2
    return greedy + seeded + sampled


def _check_recovered(bodies: list[dict[str, Any]], results: list[Result], refs: dict[str, str]) -> int:
    """Every request ended: with its full, correct text, or with worker_lost.
    Returns how many ended with worker_lost."""
    lost = 0
    for b, r in zip(bodies, results, strict=True):
        if r.error is not None:
            assert r.error == "worker_lost", r
            lost += 1
            continue
        assert r.finish_reason == "length", r
        key = json.dumps(b, sort_keys=True)
        if key in refs:
            assert r.text == refs[key], f"duplicated or missing text for {b}"
    return lost


def test_kill_9_of_an_engine_mid_stream(cluster: Cluster, model: str) -> None:
    bodies = _crash_bodies()
    unique = [json.loads(k) for k in dict.fromkeys(json.dumps(b, sort_keys=True) for b in bodies[:10])]
    refs = dict(zip([json.dumps(b, sort_keys=True) for b in unique], asyncio.run(references(cluster.urls[0], unique)), strict=True))  # fmt: skip
    victim = ""
    killed_at = 0.0

    async def kill_when_streaming() -> None:
        nonlocal killed_at, victim
        victim = await _busiest(cluster, model)
        await asyncio.sleep(0.3)  # its requests are streaming now
        cluster.engines[victim].signal(signal.SIGKILL)
        killed_at = time.monotonic()

    results = asyncio.run(_stream_all(cluster, bodies, kill_when_streaming))
    lost = _check_recovered(bodies, results, refs)
    latest = max(r.ended_at for r in results)
    log.info("kill -9: %d of %d ended with worker_lost; the last ended %.1fs after the kill", lost, len(bodies),
             latest - killed_at)  # fmt: skip
    # The lease (2 s) lets the survivor reclaim, then it reruns up to 120 tokens of 12 streams:
    # 2-4 s on a quiet machine, 8-10 s on a loaded one; a request left behind would wait for
    # the resume grace (20 s).
    assert latest - killed_at < LEASE_S + 10, "a request took too long to end after the crash"
    assert lost < len(bodies) // 2, "greedy and seeded requests should mostly resume"
    # A replacement, for the tests that follow.
    cluster.engines.pop(victim)
    cluster.start_engine()
    cluster.wait_ready(2)


def test_sigterm_on_an_engine_loses_no_request(cluster: Cluster, model: str) -> None:
    # Long enough that the victim cannot finish its share within its drain time (0.5 s)
    # however fast the machine: 120 tokens of the tiny model sometimes fit in it.
    bodies = [body(p, 600) for p in PROMPTS] * 3
    refs = dict(zip([json.dumps(b, sort_keys=True) for b in bodies[:4]], asyncio.run(references(cluster.urls[1], bodies[:4])), strict=True))  # fmt: skip
    victim = ""

    async def term_when_streaming() -> None:
        nonlocal victim
        victim = await _busiest(cluster, model)
        cluster.engines[victim].signal(signal.SIGTERM)

    results = asyncio.run(_stream_all(cluster, bodies, term_when_streaming))
    assert _check_recovered(bodies, results, refs) == 0
    assert cluster.engines[victim].wait(15) == 0
    # It had more than its drain time (0.5 s) of work: the rest went back to the queue.
    assert "back to the queue" in cluster.engines[victim].log.read_text()
    assert victim not in cluster.pending_by_engine(model), "the drained engine left its consumer behind"
    cluster.engines.pop(victim)
    cluster.start_engine()
    cluster.wait_ready(2)


def _redis_figures(cluster: Cluster) -> dict[str, Any]:
    r = cluster.redis()
    mem = r.info("memory")
    names = {k.decode() for k in r.scan_iter(count=1000)} if r.dbsize() < 5000 else set()
    return {"keys": r.dbsize(), "names": names, "used_memory": mem["used_memory"], "info": r.info()}


def test_a_soak_of_1200_short_requests_leaves_redis_as_it_found_it(cluster: Cluster) -> None:
    if is_cluster(cluster.redis_url):
        pytest.skip("the soak runs on one instance only (the suite's time); the key layout is the same")
    asyncio.run(references(cluster.urls[0], [body(PROMPTS[0], 2)]))  # the lasting keys (rate buckets) exist
    time.sleep(4.5)  # earlier tests' streams reach the end of their retention (4 s)
    before = _redis_figures(cluster)
    n_sockets, per_socket, window = 4, 300, 16

    async def one_socket(base: str, k: int) -> int:
        done = 0
        async with websockets.connect(ws_url(base), max_size=None) as ws:
            await ws.recv()
            sent = 0
            while done < per_socket:
                while sent < per_socket and sent - done < window:
                    msg = {"type": "completion", "id": f"s{k}-{sent}", "prompt": PROMPTS[sent % 4],
                           "max_tokens": 2, "temperature": 0}  # fmt: skip
                    await ws.send(orjson.dumps(msg).decode())
                    sent += 1
                m = orjson.loads(await ws.recv())
                assert m["type"] in ("started", "delta", "done", "queued"), m
                done += m["type"] == "done"
        return done

    async def go() -> list[int]:
        return await asyncio.gather(*(one_socket(cluster.urls[k % 2], k) for k in range(n_sockets)))

    t0 = time.monotonic()
    assert sum(asyncio.run(go())) == n_sockets * per_socket
    took = time.monotonic() - t0
    during = _redis_figures(cluster)
    # The retention (4 s): every per-request key expires; the results streams keep an
    # entry 4 + 2 x 0.5 s (--history-flush-s) and expire 1.25 times that after the last one.
    time.sleep(6.5)
    after = _redis_figures(cluster)
    for name, fig in (("before", before), ("right after", during), ("after the retention", after)):
        info = fig["info"]
        log.info(
            "redis INFO %s: keys=%d used_memory=%d (%s) connected_clients=%d total_commands_processed=%d",
            name, fig["keys"], fig["used_memory"], info["used_memory_human"], info["connected_clients"],
            info["total_commands_processed"],
        )  # fmt: skip
    log.info("soak: %d requests in %.1fs", n_sockets * per_socket, took)
    # each client took its whole answer: its request's keys went with it at once (they no
    # longer wait out the retention: a few of the last may still be going)...
    assert during["keys"] <= before["keys"] + n_sockets * window, (before["keys"], during["keys"], took)
    left = sorted(after["names"] - before["names"])
    assert after["keys"] <= before["keys"] + 2, (before["keys"], after["keys"], left)  # ...and are gone
    assert after["used_memory"] < before["used_memory"] + 512 * 1024
    q = Keys("wsllm").queue(cluster_model(cluster))
    assert cluster.redis().xlen(q) == 0
    # The consumers of the engines stopped earlier (kill -9, SIGTERM) are gone too.
    consumers = {c["name"].decode() for c in cluster.redis().xinfo_consumers(q, "engines")}
    assert consumers == set(cluster.engines), consumers


def cluster_model(cluster: Cluster) -> str:
    return cluster.model_dir.name


def test_a_redis_restart_gives_503s_then_recovery(cluster: Cluster, redis_server: Any) -> None:
    if is_cluster(cluster.redis_url):
        pytest.skip("restarts one instance; a cluster's failover is Redis's own")
    gw = cluster.urls[0]

    async def until(what: str, check: Any, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = await check()
            if got is not None:
                return got
            assert time.monotonic() < deadline, f"no {what} within {timeout}s"
            await asyncio.sleep(0.2)

    async def go() -> tuple[Result, httpx.Response, httpx.Response, Result]:
        async with httpx.AsyncClient(timeout=60) as http:
            in_flight = asyncio.create_task(sse_completion(http, gw, body(PROMPTS[0], 1500)))
            await asyncio.sleep(0.5)
            redis_server.stop()  # it comes back empty: no persistence in tests

            async def refused() -> httpx.Response | None:
                r = await http.post(f"{gw}/v1/completions", json=body("hi", 4))
                return r if r.status_code == 503 else None

            busy = await until("503", refused)
            not_ready = await http.get(f"{gw}/ready")
            redis_server.start()

            async def served() -> Result | None:
                if (await http.get(f"{gw}/ready")).status_code != 200:
                    return None
                return await sse_completion(http, gw, body("hi", 4))

            after = await until("recovery", served)
            return await asyncio.wait_for(in_flight, 30), busy, not_ready, after

    lost, busy, not_ready, after = asyncio.run(go())
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "model_not_ready"
    assert not_ready.status_code == 503
    assert lost.error == "worker_lost"  # the request Redis lost ends; it does not hang
    assert after.finish_reason == "length" and after.text
    cluster.wait_ready(2, timeout=30)  # every gateway and engine is back without a restart
    for url in cluster.urls:
        assert asyncio.run(sse_completion_once(url)).finish_reason == "length"


async def sse_completion_once(url: str) -> Result:
    async with httpx.AsyncClient(timeout=60) as http:
        return await sse_completion(http, url, body("again", 3))
