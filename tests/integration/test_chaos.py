"""Chaos on a real Redis deployment (issue 23): `wsllm gateway` and `wsllm engine`
child processes on a redis-server of this module's own, with its append-only file on.

- Redis paused (SIGSTOP) for 10 s, then resumed (SIGCONT);
- Redis restarted (its AOF keeps the streams);
- a gateway killed (-9) while its streams run, resumed on the other;
- the model's last engine killed (-9).

For each, every client gets its whole answer or a clear error within the configured
deadlines (small ones here), and no entry is left in any request stream. Gateway A
has a short orphan deadline (it must end requests nothing answers, quickly); B a
longer one than the pause (its streams must live through it). The tests run in
file order and share the deployment; the last engine is killed last."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import websockets
from redis_fixtures import Cluster, free_port, ws_url

ORPHAN_A_S = 3.0  # gateway A: the orphan deadline
ORPHAN_B_S = 15.0  # gateway B: longer than the pause
PAUSE_S = 10.0
SOCKET_S = 1.0  # every Redis client's socket timeout (and connect timeout)
TIMEOUTS = ["--redis-socket-timeout-s", str(SOCKET_S), "--redis-connect-timeout-s", str(SOCKET_S)]
SLACK_S = 3.0  # a watchdog tick, a reader's retry, a loaded 2-core machine


class AofRedis:
    """A redis-server with its append-only file on (fsync at every write): a restart
    keeps every stream. `pause()` / `resume()` stop and continue the process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--loglevel", "warning"]  # fmt: skip
        with open(self.workdir / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if self.client().ping():
                    return
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one cannot exit
            self.proc.terminate()
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> Any:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=1)


@dataclass
class Chaos:
    cluster: Cluster
    redis: AofRedis
    a: str  # gateway A's base URL (short orphan deadline)
    b: str  # gateway B's (longer than the pause)
    model: str

    def streams_drained(self, timeout: float = 15.0, results_too: bool = False) -> None:
        """Until no request stream and no dead-letter stream holds an entry (and, with
        `results_too`, every result stream has expired)."""
        r = self.redis.client()
        patterns = ["wsllm:{*}:q", "wsllm:{*}:dead"] + (["wsllm:{*}:o:*"] if results_too else [])
        deadline = time.monotonic() + timeout
        while True:
            left = {k.decode(): r.xlen(k) for p in patterns for k in r.scan_iter(match=p)}
            left = {k: n for k, n in left.items() if n}
            if not left:
                return
            assert time.monotonic() < deadline, f"entries left in streams: {left}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def chaos(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    server = AofRedis(tmp_path_factory.mktemp("chaos-redis"))
    server.start()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("chaos-logs"))
    try:
        cluster.start_engine(None, *TIMEOUTS)
        a = cluster.start_gateway("--orphan-timeout-s", str(ORPHAN_A_S), "--heartbeat-s", "1", *TIMEOUTS)
        b = cluster.start_gateway("--orphan-timeout-s", str(ORPHAN_B_S), "--heartbeat-s", "1", *TIMEOUTS)
        cluster.wait_ready(1)
        yield Chaos(cluster, server, a, b, tiny_model_dir.name)
    finally:
        cluster.stop()
        server.stop()


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@dataclass
class Answer:
    """What one SSE client got."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int | None = None
    request_id: str = ""
    token: str = ""  # its resume token
    last_event_id: int = 0
    ended_at: float = 0.0
    events: int = 0
    done: bool = False  # [DONE] came
    chunks: list[dict[str, Any]] = field(default_factory=list)


async def read(r: httpx.Response, ans: Answer, stop_after: int | None = None) -> Answer:
    async for line in r.aiter_lines():
        if line.startswith("id: "):
            ans.last_event_id = int(line[4:])
        elif line == "data: [DONE]":
            ans.done = True
            break
        elif line.startswith("data: "):
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                ans.error = chunk["error"]["code"]
                continue
            ans.request_id = chunk["id"]
            if chunk.get("usage"):
                ans.completion_tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                ans.text += c.get("text", "")
                ans.finish_reason = c["finish_reason"] or ans.finish_reason
            ans.events += 1
            if stop_after is not None and ans.events >= stop_after:
                return ans
    ans.ended_at = time.monotonic()
    return ans


async def stream(http: httpx.AsyncClient, base: str, b: dict[str, Any], ans: Answer) -> Answer:
    b = b | {"stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{base}/v1/completions", json=b) as r:
        assert r.status_code == 200, await r.aread()
        ans.token = r.headers["x-resume-token"]
        return await read(r, ans)


def whole(ans: Answer, max_tokens: int) -> bool:
    return (ans.done, ans.error, ans.finish_reason, ans.completion_tokens) == (
        True,
        None,
        "length",
        max_tokens,
    )


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_paused_redis_costs_streams_nothing_and_submits_a_clear_error(chaos: Chaos) -> None:
    """Streams on B (whose orphan deadline is longer than the pause) get their whole
    answers; a submit during the pause is a 503 within the socket timeout, not a hang;
    /health says 503 while Redis does not answer and 200 once it does."""
    n_tokens = 1000
    bodies = [body([11 + i, 12, 13], n_tokens) for i in range(3)]
    answers = [Answer() for _ in bodies]

    async def go() -> tuple[list[Answer], httpx.Response, float, list[int], float]:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [
                asyncio.create_task(stream(http, chaos.b, b, a)) for b, a in zip(bodies, answers, strict=True)
            ]
            await until(lambda: all(a.events for a in answers), 30, "the streams did not start")
            assert not any(a.done for a in answers), "the streams ended before the pause: make them longer"
            chaos.redis.pause()
            paused_at = time.monotonic()
            try:
                await asyncio.sleep(1)
                t = time.monotonic()
                refused = await http.post(f"{chaos.a}/v1/completions", json=body([1, 2], 5))
                refused_in = time.monotonic() - t
                health = [(await http.get(f"{u}/health")).status_code for u in (chaos.a, chaos.b)]
                await asyncio.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused_at)))
            finally:
                chaos.redis.resume()
            resumed_at = time.monotonic()
            await until(
                lambda: httpx.get(f"{chaos.a}/health").status_code == 200, SLACK_S, "/health stayed 503"
            )
            async with asyncio.timeout(60):
                done = await asyncio.gather(*tasks)
            return done, refused, refused_in, health, resumed_at

    done, refused, refused_in, health, resumed_at = asyncio.run(go())
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    assert refused.json()["error"]["code"] == "model_not_ready"
    assert refused_in < 3 * SOCKET_S + SLACK_S, f"a submit to a paused Redis took {refused_in:.1f}s"
    assert health == [503, 503]
    assert all(whole(a, n_tokens) for a in done), [
        (a.error, a.finish_reason, a.completion_tokens) for a in done
    ]
    chaos.streams_drained()


def test_a_redis_restart_with_its_aof_loses_no_stream(chaos: Chaos) -> None:
    """Redis stops and starts again with its data: the streams of both gateways carry
    on and end whole."""
    n_tokens = 600
    bodies = [body([21 + i, 22], n_tokens) for i in range(4)]
    answers = [Answer() for _ in bodies]

    async def go() -> list[Answer]:
        async with httpx.AsyncClient(timeout=60) as http:
            gws = [chaos.a, chaos.b] * 2
            tasks = [
                asyncio.create_task(stream(http, g, b, a))
                for g, b, a in zip(gws, bodies, answers, strict=True)
            ]
            await until(lambda: all(a.events for a in answers), 30, "the streams did not start")
            await asyncio.to_thread(chaos.redis.stop)
            await asyncio.to_thread(chaos.redis.start)
            async with asyncio.timeout(60):
                return await asyncio.gather(*tasks)

    done = asyncio.run(go())
    assert all(whole(a, n_tokens) for a in done), [
        (a.error, a.finish_reason, a.completion_tokens) for a in done
    ]
    chaos.cluster.wait_ready(1, timeout=30)
    chaos.streams_drained()


def test_a_killed_gateways_streams_resume_on_the_other(chaos: Chaos) -> None:
    """kill -9 of gateway A while three streams run on it: each client resumes on B
    with its token and Last-Event-ID, and gets the rest of the very same answer."""
    n_tokens = 300
    bodies = [body([31 + i, 32], n_tokens) for i in range(3)]
    answers = [Answer() for _ in bodies]
    victim = chaos.cluster.gateways[chaos.a]

    async def first_part(http: httpx.AsyncClient, b: dict[str, Any], ans: Answer) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the gateway dies under it
            await stream(http, chaos.a, b, ans)

    async def rest(http: httpx.AsyncClient, ans: Answer) -> Answer:
        more = Answer()
        headers = {"x-resume-token": ans.token, "last-event-id": str(ans.last_event_id)}
        async with http.stream("GET", f"{chaos.b}/v1/streams/{ans.request_id}", headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            return await read(r, more)

    async def go() -> list[Answer]:
        async with httpx.AsyncClient(timeout=60) as http:
            tasks = [
                asyncio.create_task(first_part(http, b, a)) for b, a in zip(bodies, answers, strict=True)
            ]
            await until(lambda: all(a.events >= 2 for a in answers), 30, "the streams did not start")
            victim.signal(signal.SIGKILL)
            await asyncio.gather(*tasks)
            async with asyncio.timeout(60):
                return await asyncio.gather(*(rest(http, a) for a in answers))

    rests = asyncio.run(go())
    assert all(not a.done for a in answers), "a stream ended before its gateway died: make them longer"
    refs = asyncio.run(references(chaos.b, bodies))
    for first, more, ref in zip(answers, rests, refs, strict=True):
        assert whole(more, n_tokens) and first.text + more.text == ref.text, (first.text, more.text, ref.text)
    # A's place is taken by a new gateway with the same flags, for the last test.
    chaos.cluster.gateways.pop(chaos.a)
    chaos.a = chaos.cluster.start_gateway(
        "--orphan-timeout-s", str(ORPHAN_A_S), "--heartbeat-s", "1", *TIMEOUTS
    )
    chaos.cluster.wait_ready(1)
    chaos.streams_drained()


async def references(base: str, bodies: list[dict[str, Any]]) -> list[Answer]:
    async with httpx.AsyncClient(timeout=60) as http:
        return list(await asyncio.gather(*(stream(http, base, b, Answer()) for b in bodies)))


def test_the_last_engine_killed_ends_every_request_with_worker_lost(chaos: Chaos) -> None:
    """kill -9 of the model's only engine under SSE streams, a plain call and a
    WebSocket request on A: each ends with `worker_lost` within A's deadline (503 with
    Retry-After for the plain call), its resume token names nothing any more, and its
    queue entry is gone. Before issue 23 they hung for ever."""
    (engine_id,) = chaos.cluster.engines
    engine = chaos.cluster.engines[engine_id]
    answers = [Answer() for _ in range(3)]
    queued = Answer()  # sent after the kill: it waits in the queue, behind nothing

    async def ws_request() -> dict[str, Any]:
        async with websockets.connect(ws_url(chaos.a)) as ws:
            await ws.recv()  # hello
            msg = {"type": "completion", "id": "w"} | body([51, 52], 1500)
            await ws.send(orjson.dumps(msg).decode())
            while True:
                got = orjson.loads(await ws.recv())
                if got["type"] in ("done", "error"):
                    return dict(got)

    async def go() -> tuple[Any, ...]:
        async with httpx.AsyncClient(timeout=60) as http:
            streams = [
                asyncio.create_task(stream(http, chaos.a, body([41 + i, 42], 1500), a))
                for i, a in enumerate(answers)
            ]
            plain = asyncio.create_task(http.post(f"{chaos.a}/v1/completions", json=body([45, 46], 1500)))
            ws = asyncio.create_task(ws_request())
            await until(lambda: all(a.events for a in answers), 30, "the streams did not start")
            engine.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            late = asyncio.create_task(stream(http, chaos.a, body([47, 48], 10), queued))
            async with asyncio.timeout(60):
                done = await asyncio.gather(*streams, plain, ws, late)
            gone = [
                (await http.get(f"{chaos.a}/v1/streams/{a.request_id}", headers={"x-resume-token": a.token}))
                for a in answers
            ]
            return killed_at, done, gone

    killed_at, (*streamed, plain, ws_end, late), gone = asyncio.run(go())
    # the streams started: nothing comes for them after the kill (ORPHAN_A_S)
    assert [a.error for a in streamed] == ["worker_lost"] * 3 and all(a.done for a in streamed), streamed
    assert max(a.ended_at for a in streamed) - killed_at < ORPHAN_A_S + SLACK_S
    assert plain.status_code == 503 and plain.headers["retry-after"], plain.text
    assert plain.json()["error"]["code"] == "worker_lost"
    assert (ws_end["type"], ws_end["code"]) == ("error", "worker_lost"), ws_end
    # queued after the kill: the engine is seen gone (its heartbeat's TTL), then the deadline
    assert late.error == "worker_lost" and late.ended_at - killed_at < 2.0 + ORPHAN_A_S + SLACK_S
    assert all(g.status_code == 404 for g in gone), [g.text for g in gone]
    chaos.cluster.engines.pop(engine_id)
    chaos.streams_drained(results_too=True)  # result streams expire after their retention (4 s)
