"""docker-compose.yml, the Dockerfile and .env.example stay true to the code: every
WSLLM_* name is a config field (or a name the code reads), every command is a `wsllm`
subcommand whose flags parse, ports agree. No Docker engine runs here, so the stack's
commands also run as local processes with the same environment, against a local
redis-server, and a chat goes through the gateway."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from wsllm.kernels import native

from wsllm.cli import COMMANDS, build_parser
from wsllm.config import from_args
from wsllm.loadgen import BenchConfig
from wsllm.loadgen.runner import main

ROOT = Path(__file__).resolve().parents[2]
WSLLM_SERVICES = ("gateway", "engine", "engine-cpu")
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


@cache
def env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(value: Any, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.groups()
        if op == ":-" and not env.get(name):
            return default
        if op == "-" and name not in env:
            return default
        return env.get(name, "")

    return _VAR.sub(sub, str(value))


def compose_vars() -> set[str]:
    return {m.group(1) for m in _VAR.finditer((ROOT / "docker-compose.yml").read_text()) if m.group(1)}


def service_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """A service's container environment, interpolated as `docker compose` would."""
    raw = compose()["services"][name].get("environment") or {}
    return {k: interpolate(v, env) for k, v in raw.items()}


def config_env_names(command: str) -> set[str]:
    return {"WSLLM_" + f.name.upper() for cls in COMMANDS[command].configs for f in dataclasses.fields(cls)}


@cache
def names_read_by_code() -> set[str]:
    """WSLLM_* names the code reads directly (not through a config field)."""
    files = [*(ROOT / "wsllm").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]  # wsllm.kernels too
    text = "\n".join(p.read_text() for p in files)
    return set(re.findall(r"[\"'](WSLLM_[A-Z0-9_]+)[\"']", text))


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    lines, buf = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
            buf = ""
    return lines


# -- the files agree with the code --------------------------------------------------------------


def test_services_commands_and_env_names_exist_in_the_code() -> None:
    env = env_example()
    for name in WSLLM_SERVICES:
        svc = compose()["services"][name]
        command = svc["command"]
        assert command[0] in COMMANDS, f"{name}: `wsllm {command[0]}` is not a subcommand"
        args = build_parser().parse_args(command)  # its flags exist
        cenv = service_env(name, env)
        known = config_env_names(command[0]) | names_read_by_code()
        unknown = sorted(k for k in cenv if k.startswith("WSLLM_") and k not in known)
        assert not unknown, f"{name}: {unknown} are not fields of `wsllm {command[0]}`'s configs"
        # and the values parse as those fields' types
        with pytest.MonkeyPatch.context() as mp:
            for k, v in cenv.items():
                mp.setenv(k, v)
            for cls in COMMANDS[command[0]].configs:
                from_args(cls, args)


def test_env_example_and_dockerfile_names_exist_in_the_code() -> None:
    every_field = set().union(*(config_env_names(c) for c in COMMANDS)) | names_read_by_code()
    example = env_example()
    assert not sorted(k for k in example if k.startswith("WSLLM_") and k not in every_field)
    # every variable the compose file reads is documented in .env.example
    assert compose_vars() <= set(example), sorted(compose_vars() - set(example))
    env_lines = [rest for word, rest in dockerfile() if word == "ENV"]
    names = {m for rest in env_lines for m in re.findall(r"(WSLLM_[A-Z0-9_]+)=", rest)}
    assert names and names <= every_field, sorted(names - every_field)


def test_ports_agree() -> None:
    env = env_example()
    gw = compose()["services"]["gateway"]
    genv = service_env("gateway", env)
    (mapping,) = gw["ports"]
    bind, host, container = interpolate(mapping, env).split(":")
    assert host == env["GATEWAY_PORT"] and container == genv["WSLLM_PORT"] == "8000"
    # Published on the loopback only, unless the operator says otherwise: no key by default.
    assert bind == "127.0.0.1" == interpolate(mapping, {}).split(":")[0] and not env["WSLLM_API_KEY"]
    assert f"127.0.0.1:{container}/health" in " ".join(gw["healthcheck"]["test"])
    df = dockerfile()
    assert ("EXPOSE", container) in df
    assert any(word == "ENV" and f"WSLLM_PORT={container}" in rest for word, rest in df)
    assert any(word == "HEALTHCHECK" and "WSLLM_PORT" in rest and "/health" in rest for word, rest in df)


def test_stack_shape() -> None:
    services = compose()["services"]
    assert set(services) == {"redis", *WSLLM_SERVICES}
    redis = services["redis"]
    assert (
        "--appendonly" in redis["command"]
        and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    )
    # Redis's memory is bounded, and full it refuses writes instead of evicting a stream
    argv = redis["command"]
    assert argv[argv.index("--maxmemory") + 1] and argv[argv.index("--maxmemory-policy") + 1] == "noeviction"
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in WSLLM_SERVICES:
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service_env(name, env_example())["WSLLM_BROKER"].startswith("redis://redis:6379")
    # --scale engine=N: engines have no fixed name and no host port
    for name in ("engine", "engine-cpu"):
        assert "container_name" not in services[name] and "ports" not in services[name]
    (device,) = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in device["capabilities"] and "profiles" not in services["engine"]
    assert services["engine-cpu"]["profiles"] == ["cpu"]
    assert service_env("engine", {})["WSLLM_DEVICE"] == "cuda"
    assert service_env("engine-cpu", {})["WSLLM_DEVICE"] == "cpu"


def _bytes(size: str) -> int:
    """Redis's size notation (`1gb`, `512mb`) in bytes."""
    m = re.fullmatch(r"(\d+)(kb|mb|gb)?", size.lower())
    assert m, size
    return int(m[1]) * {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, None: 1}[m[2]]


def test_redis_maxmemory_holds_the_load_the_compose_file_names() -> None:
    """The compose file's `maxmemory` and the bounds of what Redis keeps agree: the load its
    comment names (7,000 tokens/s with logprobs: 20, 4 engines of 64 sequences, 8 tenants
    at the default budgets) fits with half again to spare (docs/deployment.md)."""
    from wsllm.broker.redis_retention import Load, redis_memory
    from wsllm.config_gateway import GatewayConfig
    from wsllm.config_redis import RedisConfig

    argv = compose()["services"]["redis"]["command"]
    maxmemory = _bytes(argv[argv.index("--maxmemory") + 1])
    text = (ROOT / "docker-compose.yml").read_text()
    assert "7,000 tokens/s" in text and "8 tenants" in text  # the load it is sized for, said there
    load = Load(tokens_per_s=7000, bytes_per_token=459, in_flight=4 * 64, max_tokens=512, tenants=8)
    need = redis_memory(load, RedisConfig(), GatewayConfig().response_tenant_max_bytes)
    assert 1.5 * need <= maxmemory, (need >> 20, maxmemory >> 20)


def test_dockerfile_shape() -> None:
    df = dockerfile()
    stages = [rest.split()[-1] for word, rest in df if word == "FROM" and " AS " in rest]
    assert {"base-cpu", "base-cuda"} <= set(stages)
    assert ("FROM", "base-${BASE}") in df and ("ARG", "BASE=cpu") in df
    users = [rest for word, rest in df if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("ENTRYPOINT", '["wsllm"]') in df
    (cmd,) = [rest for word, rest in df if word == "CMD"]
    assert yaml.safe_load(cmd)[0] in COMMANDS
    # every COPY source exists and is not excluded by .dockerignore
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for word, rest in df:
        if word == "COPY":
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists() and src.rstrip("/") not in ignored, src


# -- the stack's commands as local processes ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_check(test: list[str], env: dict[str, str], timeout: float = 10.0) -> int:
    """A compose healthcheck's `test` ("CMD", ...) run here."""
    assert test[0] == "CMD", test
    argv = [sys.executable if a == "python" else a for a in test[1:]]
    return subprocess.run(argv, env=env, timeout=timeout, capture_output=True).returncode


@contextlib.contextmanager
def compose_redis(tmp: Path) -> Iterator[tuple[str, int]]:
    """The `redis` service's command (AOF on) with a local port and data dir."""
    svc = compose()["services"]["redis"]
    port = free_port()
    argv = ["/usr/bin/redis-server", *svc["command"][1:], "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(tmp)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        # its healthcheck, pointed at the local port
        cmd, cli, *rest = svc["healthcheck"]["test"]
        check = [cmd, shutil.which(cli) or "/usr/bin/redis-cli", "-p", str(port), *rest]
        deadline = time.monotonic() + 10
        while run_check(check, dict(os.environ)) != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not become healthy"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}", port
    finally:
        proc.terminate()
        proc.wait(10)


def local_env(name: str, redis_base: str, **overrides: str) -> dict[str, str]:
    """The service's environment as the container sees it (the Dockerfile's ENV, then the
    compose environment), with the Redis host pointed here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSLLM_")}
    for word, rest in dockerfile():
        if word == "ENV":
            env.update(dict(re.findall(r"(WSLLM_[A-Z0-9_]+)=(\S+)", rest)))
    env.update(service_env(name, env_example()))
    env["WSLLM_BROKER"] = env["WSLLM_BROKER"].replace("redis://redis:6379", redis_base)
    env.update(overrides)
    return env


@contextlib.contextmanager
def service(name: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`docker compose up <name>` as a local process: the image's ENTRYPOINT is `wsllm`."""
    argv = [sys.executable, "-m", "wsllm", *compose()["services"][name]["command"]]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # what `docker compose stop` sends
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_stack_serves_a_chat(tiny_model_dir: Path, tmp_path: Path, capsys: Any) -> None:
    port = free_port()
    common = {
        "WSLLM_MODEL": str(tiny_model_dir),
        "WSLLM_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    with compose_redis(tmp_path) as (redis_base, _):
        genv = local_env("gateway", redis_base, WSLLM_HOST="127.0.0.1", WSLLM_PORT=str(port), **common)
        # a small KV pool: the tiny model's tokens are 512 bytes, 1 GiB would take a while to zero
        eenv = local_env("engine-cpu", redis_base, WSLLM_KV_CACHE_GB="0.01", WSLLM_THREADS="1", **common)
        # The image builds the native kernels into WSLLM_KERNELS_DIR; here they are where
        # `make` built them for this checkout (else the engine would compile them at start).
        eenv["WSLLM_KERNELS_DIR"] = str(native.cache_root())
        base = f"http://127.0.0.1:{port}"
        with service("engine-cpu", eenv, tmp_path / "engine.log") as engine, \
                service("gateway", genv, tmp_path / "gateway.log") as gateway:  # fmt: skip
            deadline = time.monotonic() + 90
            while True:  # /ready: the gateway is up and has an engine's heartbeat
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                        break
                for p, log in ((engine, "engine.log"), (gateway, "gateway.log")):
                    assert p.poll() is None, (tmp_path / log).read_text()[-3000:]
                assert time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()[-3000:]
                time.sleep(0.2)
            # the services' healthchecks pass (the gateway's pointed at the local port)
            gtest = compose()["services"]["gateway"]["healthcheck"]["test"]
            gcheck = [a.replace(":8000/", f":{port}/") for a in gtest]
            echeck = compose()["services"]["engine-cpu"]["healthcheck"]["test"]
            assert run_check(gcheck, genv) == 0 and run_check(echeck, eenv) == 0
            r = httpx.post(
                f"{base}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 8,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert body["usage"]["completion_tokens"] == 8
            # and streamed, over SSE and the WebSocket, through the same stack
            for transport in ("sse", "ws"):
                cfg = BenchConfig(base_url=base, transport=transport, concurrency="4", num_requests=4,
                                  input_len=8, output_len=4, ignore_eos=True)  # fmt: skip
                assert main(cfg) == 0, capsys.readouterr().err
                assert "| requests ok / failed | 4 / 0 |" in capsys.readouterr().out
            gateway.send_signal(signal.SIGTERM)
            engine.send_signal(signal.SIGTERM)
            # `docker compose stop`: the engine drains and exits 0; uvicorn shuts the gateway
            # down cleanly, then re-raises the signal (exit status 143 in a container)
            assert engine.wait(30) == 0, (tmp_path / "engine.log").read_text()[-3000:]
            assert gateway.wait(30) in (0, -signal.SIGTERM)
            assert "Finished server process" in (tmp_path / "gateway.log").read_text()
            assert run_check(echeck, eenv) != 0  # a stopped engine is not healthy
