"""The progress watchdog (wsllm/engine/watchdog.py): an engine with work that completes
no step within `--stall-timeout-s` is stuck. In-process (the memory broker), a step
held on purpose: the streams it served end with `engine_stalled`, /health says 503 with
the reason, and the server is told to stop. On Redis, an engine whose steps outlast the
timeout (a fake engine of 4-second steps): its request goes back to the queue, the
process exits with status 3 for its supervisor, and a fresh engine finishes the request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from redis_fixtures import Cluster, sse_text

from wsllm.engine.fake import fake_token_ids
from wsllm.engine.watchdog import EXIT_STALLED, Watchdog

STALL_S = 1.0


class HeldSteps:
    """The real engine, whose next step can be held on purpose (`hold`) until `release`."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.hold, self.released = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[Any]:
        if self.hold.is_set():
            self.released.wait(60)
        return list(self._engine.step())


@pytest.fixture(scope="module")
def held(tiny_engine: Any) -> HeldSteps:
    return HeldSteps(tiny_engine)


@pytest.fixture(scope="module")
def srv(live_server: Any, held: HeldSteps) -> Iterator[Any]:
    with live_server(held) as s:
        yield s
        held.released.set()  # the stuck step returns: the worker drops its results and ends


def test_a_held_step_ends_its_streams_with_engine_stalled_and_health_says_why(
    srv: Any, held: HeldSteps
) -> None:
    stalls: list[str] = []
    dog = Watchdog(srv.worker, STALL_S, stalls.append, 4.0).start()
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    assert httpx.get(f"{srv.base_url}/health").status_code == 200
    error: dict[str, Any] = {}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{srv.base_url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("id: ")
        held.hold.set()  # the next step never returns
        t0 = time.monotonic()
        for line in lines:
            if line.startswith("data: {") and "error" in (chunk := orjson.loads(line[6:])):
                error = chunk["error"]
                break
        waited = time.monotonic() - t0
    dog.stop()
    assert error.get("code") == "engine_stalled" and "one step" in error["message"], error
    assert waited < STALL_S + 3, waited
    assert stalls and srv.worker.stalled == stalls[0]
    health = httpx.get(f"{srv.base_url}/health")
    assert health.status_code == 503 and "has been in one step" in health.json()["reason"], health.text


def test_a_stuck_engine_hands_its_request_back_and_exits_for_its_supervisor(
    redis_server: Any, smollm_dir: Path, tmp_path: Path
) -> None:
    redis_server.client().flushdb()
    cluster = Cluster(redis_server.url, smollm_dir, tmp_path)
    try:
        # factor 1: its first step (a fresh engine's) is stuck past the timeout alone
        flags = ["--fake-step-ms", "4000", "--stall-timeout-s", str(STALL_S), "--stall-factor", "1"]
        cluster.start_engine("stuck", *flags)
        base = cluster.start_gateway()
        cluster.wait_ready(engines=1)

        async def go() -> tuple[Any, int]:
            answer = asyncio.create_task(sse_text(base, {"prompt": "hi", "max_tokens": 6}))
            status = await asyncio.to_thread(cluster.engines["stuck"].wait, 30)
            cluster.start_engine("fresh", "--fake-step-ms", "20")
            return await asyncio.wait_for(answer, 60), status

        res, status = asyncio.run(go())
        assert status == EXIT_STALLED, cluster.engines["stuck"].tail()
        assert "has been in one step" in cluster.engines["stuck"].tail()
        from tokenizers import Tokenizer

        ids = fake_token_ids(smollm_dir)
        want = Tokenizer.from_file(str(smollm_dir / "tokenizer.json")).decode(
            [ids[i % len(ids)] for i in range(6)]
        )
        assert res.error is None and res.finish_reason == "length" and res.text == want, res
    finally:
        cluster.stop()
