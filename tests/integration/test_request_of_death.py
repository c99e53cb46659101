"""A request of death on Redis: a request that stalls every engine it reaches (the
test-only hold of wsllm/engine/intake.py, `WSLLM_TEST_HOLD_STEP_TOKEN`) against two
`wsllm serve --broker redis://` processes, each supervising its engine child (fake
engines: no model). The first engine's watchdog hands it back once, marked; the second
ends it with `engine_stalled` naming it, and it never reaches a third engine; both
children exit with status 3, their supervisors start them again, and both serve within
30 s. The stall timeout is longer than the lease: a stuck engine's watchdog keeps its
leases fresh, so the request leaves it by the watchdog's hand-back alone (marked), never
by a reclaim that would know nothing of the stall."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis_fixtures import FAST_FLAGS, Proc, free_port, sse_text

from wsllm.broker.redis_keys import GROUP, Keys

DEATH = 4711  # the token whose requests hold their engine's step
STALL_S = 3.0  # longer than the lease (2 s): a stuck engine keeps its leases, nobody reclaims


class Serve(Proc):
    """`wsllm serve --broker redis://` with a fake engine child."""

    def __init__(self, name: str, url: str, model_dir: Path, logs: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "info", "--model", str(model_dir),
               "--broker", url, "--port", str(self.port), "--no-frontend", "--fake-step-ms", "20",
               "--stall-timeout-s", str(STALL_S), *FAST_FLAGS]  # fmt: skip
        os.environ["WSLLM_TEST_HOLD_STEP_TOKEN"] = str(DEATH)
        try:
            super().__init__(name, cmd, logs / f"{name}.log")
        finally:
            del os.environ["WSLLM_TEST_HOLD_STEP_TOKEN"]

    def exits(self) -> int:
        """How many times its engine child exited with status 3 (a stall)."""
        return self.log.read_text(errors="replace").count("engine child exited with status 3")


def wait_serving(serves: list[Serve], engines: int, timeout: float) -> float:
    """Until every gateway says healthy and ready with `engines` engines; the seconds it took."""
    t0 = time.monotonic()
    for s in serves:
        while True:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                health = httpx.get(f"{s.base}/health", timeout=2)
                ready = httpx.get(f"{s.base}/ready", timeout=2)
                if (
                    health.status_code == 200
                    and ready.status_code == 200
                    and ready.json()["engines"] >= engines
                ):
                    break
            assert s.alive(), f"{s.name} exited:\n{s.tail()}"
            assert time.monotonic() - t0 < timeout, f"{s.name} not serving after {timeout}s:\n{s.tail()}"
            time.sleep(0.1)
    return time.monotonic() - t0


def warm(serves: list[Serve], rc: Any) -> None:
    """Until both engines have taken steps (their heartbeats say)."""
    keys = Keys("wsllm")

    def steps() -> list[int]:
        out = []
        for e in rc.smembers(keys.engines):
            raw = rc.get(keys.engine(e.decode()))
            out.append(orjson.loads(raw)["stats"]["num_steps"] if raw else 0)
        return out

    async def some() -> None:
        bodies = [{"prompt": [5, 6, 7], "max_tokens": 2}] * 4
        await asyncio.gather(*(sse_text(serves[i % 2].base, b) for i, b in enumerate(bodies)))

    deadline = time.monotonic() + 60
    while len(s := steps()) < 2 or min(s) == 0:
        assert time.monotonic() < deadline, s
        asyncio.run(asyncio.wait_for(some(), 60))
        time.sleep(0.5)  # a heartbeat


def test_a_request_of_death_stalls_two_engines_at_most_and_both_serve_again(
    redis_server: Any, smollm_dir: Path, tmp_path: Path
) -> None:
    rc = redis_server.client()
    rc.flushdb()
    serves = [Serve(name, redis_server.url, smollm_dir, tmp_path) for name in ("serve-a", "serve-b")]
    try:
        wait_serving(serves, engines=2, timeout=90)
        warm(serves, rc)  # a fresh engine's first step has a longer bound (it warms up)
        body = {"prompt": [DEATH, 5, 6], "max_tokens": 8}
        res = asyncio.run(asyncio.wait_for(sse_text(serves[0].base, body), 60))
        assert res.error == "engine_stalled", res
        assert res.request_id is None or res.request_id in res.error_message
        assert "handed to another engine at most once" in res.error_message, res.error_message
        # both engines stalled once, and each supervisor starts its engine again
        took = wait_serving(serves, engines=2, timeout=30)
        assert sum(s.exits() for s in serves) == 2, [s.tail() for s in serves]
        assert all(s.exits() == 1 for s in serves), [s.tail() for s in serves]

        # serving again, on both gateways (and, across them, both engines)
        async def answers() -> list[Any]:
            bodies = [{"prompt": [5, 6, 7], "max_tokens": 4}] * 6
            return await asyncio.gather(*(sse_text(serves[i % 2].base, b) for i, b in enumerate(bodies)))

        for r in asyncio.run(asyncio.wait_for(answers(), 60)):
            assert r.error is None and r.finish_reason == "length", r
        # the request of death reached no third engine: nothing of it waits or is pending
        time.sleep(3 * STALL_S)
        assert sum(s.exits() for s in serves) == 2, [s.tail() for s in serves]
        queue = Keys("wsllm").queue(smollm_dir.name)
        assert rc.xpending(queue, GROUP)["pending"] == 0
        assert not rc.hget(f"{queue}:n", "h"), "a hand-back still waits"
        print(f"serving again {took:.1f}s after the request of death ended")
    finally:
        for s in serves:
            s.stop()
