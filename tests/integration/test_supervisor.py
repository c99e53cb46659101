"""`wsllm serve` supervising its engine: with `--broker redis://` its engine child is
killed (`kill -9`): `/health` says 503 with the reason until a new child is live, the new
child comes within 30 s, and the request it was serving is recovered (a greedy one,
replayed) or ends with `worker_lost`. In memory, a stalled engine ends its request with
`engine_stalled` and the process exits with status 3 (not SIGABRT)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from redis_fixtures import FAST_FLAGS, Proc, free_port, read_sse
from test_redis_cli import children

from wsllm.engine.watchdog import EXIT_STALLED


def wait_live(base: str, timeout: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready = httpx.get(f"{base}/ready", timeout=2)
            if httpx.get(f"{base}/health", timeout=2).status_code == 200 and ready.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.alive() and time.monotonic() < deadline, proc.tail()
        time.sleep(0.1)


def test_a_killed_engine_child_is_restarted_and_health_says_503_meanwhile(
    redis_server: Any, smollm_dir: Path, tmp_path: Path
) -> None:
    redis_server.client().flushdb()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "info", "--model", str(smollm_dir),
           "--broker", redis_server.url, "--port", str(port), "--no-frontend", "--fake-step-ms", "50", *FAST_FLAGS]  # fmt: skip
    serve = Proc("serve", cmd, tmp_path / "serve.log")
    try:
        wait_live(base, 90, serve)
        (child,) = children(serve.popen.pid)

        async def go() -> tuple[Any, list[tuple[float, int, str]]]:
            from redis_fixtures import Result

            res, seen = Result(), []
            body = {"prompt": [5, 6, 7], "max_tokens": 80, "temperature": 0, "stream": True}
            async with (
                httpx.AsyncClient(timeout=120) as http,
                http.stream("POST", f"{base}/v1/completions", json=body) as r,
            ):
                assert r.status_code == 200
                reading = asyncio.create_task(read_sse(r, res))
                while not res.text:  # it runs on the child
                    await asyncio.sleep(0.02)
                os.kill(child, signal.SIGKILL)
                killed = time.monotonic()
                while True:  # /health until the new child is live
                    h = await http.get(f"{base}/health")
                    seen.append((time.monotonic() - killed, h.status_code, h.json().get("reason", "")))
                    down = any(code == 503 for _, code, _ in seen)
                    if (h.status_code == 200 and down) or time.monotonic() - killed > 40:
                        break
                    await asyncio.sleep(0.1)
                await reading
            return res, seen

        res, seen = asyncio.run(go())
        down = [s for s in seen if s[1] == 503]
        assert down and "killed by signal 9" in down[0][2], seen[:3]
        assert seen[-1][1] == 200 and seen[-1][0] < 30, seen[-3:]
        print(f"/health 503 {down[0][0]:.2f}s after the kill, 200 again after {seen[-1][0]:.1f}s")
        (new_child,) = children(serve.popen.pid)
        assert new_child != child
        # the request it served: replayed on the new child (greedy), or a clear worker_lost
        assert (res.error is None and res.finish_reason == "length") or res.error == "worker_lost", res
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        serve.stop()
    assert serve.popen.returncode == 0, serve.tail()


def test_a_stalled_engine_in_memory_exits_with_status_3(tiny_model_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "warning", "--model", str(tiny_model_dir),
           "--port", str(port), "--num-kv-blocks", "64", "--threads", "1", "--no-frontend",
           "--stall-timeout-s", "1"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", WSLLM_TEST_HOLD_STEP_TOKEN="4711")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "wsllm serve never got ready"
            time.sleep(0.2)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [4711, 5], "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_STALLED, (proc.returncode, out[-2000:])
    assert "terminate called" not in out and "has been in one step" in out, out[-2000:]
