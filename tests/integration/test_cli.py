"""`wsllm serve`: flags come from the config dataclasses; it serves and prints the URL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from wsllm.cli import build_parser
from wsllm.config import EngineConfig, from_args
from wsllm.config_gateway import GatewayConfig
from wsllm.config_process import LogConfig, ModelRefConfig
from wsllm.config_redis import RedisConfig


def test_serve_flags_are_derived_from_both_configs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WSLLM_MAX_N", "3")
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--model", "n", "--port", "9001", "--kv-cache-gb", "0.5", "--no-frontend"]
    )
    e, g, m = from_args(EngineConfig, args), from_args(GatewayConfig, args), from_args(ModelRefConfig, args)
    assert (m.model, e.kv_cache_gb, g.port, g.frontend, g.max_n) == (["m", "n"], 0.5, 9001, False, 3)


def test_each_option_has_one_name_in_every_command(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The broker URL, the model and the log level: one field each, the same flag in
    serve, gateway and engine (--redis-url and WSLLM_REDIS_URL stay as aliases)."""
    url = "redis://h:6379/1"
    for command in ("serve", "gateway", "engine"):
        args = build_parser().parse_args(
            [
                command,
                "--redis-url",
                url,
                "--model",
                "m",
                "--model-name",
                "a",
                "--model-name",
                "b",
                "--log-level",
                "debug",
            ]
        )
        r, m, log = from_args(RedisConfig, args), from_args(ModelRefConfig, args), from_args(LogConfig, args)
        assert (r.url(), m.served_name, m.aliases, log.log_level) == (url, "a", ["b"], "debug")
    monkeypatch.setenv("WSLLM_REDIS_URL", url)
    assert from_args(RedisConfig, build_parser().parse_args(["engine"])).broker == url
    assert from_args(
        RedisConfig, build_parser().parse_args(["engine", "--broker", "redis://x:1/0"])
    ).url() == ("redis://x:1/0")
    with pytest.raises(ValueError, match="--model-name names one model"):
        ModelRefConfig(model=["a", "b"], model_name=["x"])
    with pytest.raises(ValueError, match="broker must be memory"):
        RedisConfig(broker="http://nope")


def test_wsllm_serve_prints_the_url_and_serves(tiny_model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "wsllm",
        "serve",
        "--log-level",
        "warning",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--num-kv-blocks",
        "64",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("wsllm: serving ") and f"http://127.0.0.1:{port}/" in line, line
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "wsllm serve did not become ready"
            time.sleep(0.1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert "<html" in httpx.get(f"http://127.0.0.1:{port}/").text.lower()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
