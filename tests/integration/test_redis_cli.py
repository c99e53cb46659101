"""`wsllm serve --redis-url`: the gateway here and an engine child process, joined by
Redis; SIGTERM (docker stop, a supervisor) stops both, and no engine stays registered.
The Redis password never shows on a command line."""

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

from wsllm.broker.redis_keys import Keys

PASSWORD = "s3cret-pw-4711"


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_serve_with_redis_runs_an_engine_child_and_stops_it(redis_server: Any, tiny_model_dir: Path) -> None:
    rc = redis_server.client()
    rc.flushall()
    # A user with a password, so that the URL carries one (the default user stays as it is).
    rc.execute_command("ACL", "SETUSER", "wsllm-test", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    url = redis_server.url.replace("redis://", f"redis://wsllm-test:{PASSWORD}@")
    port = free_port()
    cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "warning", "--model", str(tiny_model_dir),
           "--port", str(port), "--num-kv-blocks", "64", "--threads", "1", "--no-frontend"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", WSLLM_REDIS_URL=url))  # fmt: skip
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
        assert redis_server.client().scard(Keys("wsllm").engines) == 1
        (child,) = children(proc.pid)
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert " engine " in cmdline and PASSWORD not in cmdline, cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert redis_server.client().scard(Keys("wsllm").engines) == 0, "the engine child did not deregister"
    rc.execute_command("ACL", "DELUSER", "wsllm-test")
