"""`wsllm serve --redis-url`: the gateway here and an engine child process, joined by
Redis; SIGTERM (docker stop, a supervisor) stops both, and no engine stays registered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from redis_fixtures import free_port


def test_serve_with_redis_runs_an_engine_child_and_stops_it(redis_server: Any, tiny_model_dir: Path) -> None:
    redis_server.client().flushall()
    port = free_port()
    cmd = [sys.executable, "-m", "wsllm", "--log-level", "warning", "serve", "--model", str(tiny_model_dir),
           "--port", str(port), "--redis-url", redis_server.url, "--num-kv-blocks", "64", "--threads", "1",
           "--no-frontend"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (
                "wsllm serve --redis-url never got ready"
            )
            time.sleep(0.2)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert redis_server.client().scard("wsllm:engines") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert redis_server.client().scard("wsllm:engines") == 0, "the engine child did not deregister"
