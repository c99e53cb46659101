"""A Redis deployment in child processes for the tests: `wsllm engine` and `wsllm
gateway` on the session's redis-server (tests/conftest.py), with a tiny model and
short leases, plus small SSE and WebSocket clients that keep everything a test
checks (text, seq, finish reason, error code).

    cluster = Cluster(redis_server.url, tiny_model_dir, tmp_path)
    cluster.start(gateways=2, engines=2)
    ...
    cluster.stop()

`Deployment` is the mixed one of the `redis_deployment` fixture (tests/integration/
conftest.py): the engine and gateway A in this process, gateway B a child process.

`RedisClusterServer` is a 3-master Redis Cluster on local ports (the session's
`redis_cluster` fixture, tests/conftest.py); `redis_client(url)` a blocking client of
either kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import websockets

from wsllm.broker.redis_conn import is_cluster, sync_client
from wsllm.broker.redis_keys import Keys
from wsllm.config_redis import RedisConfig

ROOT = Path(__file__).resolve().parents[2]

# Short times so that recovery happens within a test's patience.
FAST_FLAGS = [
    "--lease-s", "2", "--engine-heartbeat-s", "0.2", "--engine-ttl-s", "2",
    "--stream-retention-s", "4", "--resume-grace-s", "20", "--queue-poll-s", "0.2",
    "--drain-timeout-s", "0.5", "--history-flush-s", "0.5",
]  # fmt: skip
ENGINE_FLAGS = ["--threads", "1", "--num-kv-blocks", "1024", "--max-num-seqs", "16"]
LEASE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@dataclass
class Cluster:
    redis_url: str
    model_dir: Path
    logs: Path
    engines: dict[str, Proc] = field(default_factory=dict)
    gateways: dict[str, Proc] = field(default_factory=dict)  # base URL -> process
    _n: int = 0

    def _wsllm(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "wsllm", args[0], "--log-level", "info", *args[1:]]

    def start_engine(self, engine_id: str | None = None, *extra: str, model_dir: Path | None = None) -> str:
        self._n += 1
        engine_id = engine_id or f"engine-{self._n}"
        cmd = self._wsllm(
            "engine", "--model", str(model_dir or self.model_dir), "--broker", self.redis_url,
            "--engine-id", engine_id, *ENGINE_FLAGS, *FAST_FLAGS, *extra,
        )  # fmt: skip
        self.engines[engine_id] = Proc(engine_id, cmd, self.logs / f"{engine_id}.log")
        return engine_id

    def start_gateway(self, *extra: str, model_dir: Path | None = None) -> str:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = self._wsllm(
            "gateway", "--model", str(model_dir or self.model_dir), "--broker", self.redis_url,
            "--port", str(port), "--no-frontend", *FAST_FLAGS, *extra,
        )  # fmt: skip
        self.gateways[base] = Proc(f"gateway-{port}", cmd, self.logs / f"gateway-{port}.log")
        return base

    def start(self, gateways: int, engines: int) -> None:
        for _ in range(engines):
            self.start_engine()
        for _ in range(gateways):
            self.start_gateway()
        self.wait_ready(engines)

    def wait_ready(self, engines: int, timeout: float = 90.0) -> None:
        """Until every gateway is ready and sees `engines` live engines."""
        deadline = time.monotonic() + timeout
        for base, proc in self.gateways.items():
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(f"{base}/ready", timeout=2)
                    if r.status_code == 200 and r.json()["engines"] >= engines:
                        break
                for p in [proc, *self.engines.values()]:
                    assert p.alive(), f"{p.name} exited:\n{p.tail()}"
                assert time.monotonic() < deadline, f"{base} not ready with {engines} engines"
                time.sleep(0.1)

    @property
    def urls(self) -> list[str]:
        return list(self.gateways)

    def redis(self) -> Any:
        return redis_client(self.redis_url)

    def pending_by_engine(self, model: str) -> dict[str, int]:
        """Requests each engine holds now (its pending entries)."""
        info = self.redis().xpending(Keys("wsllm").queue(model), "engines")
        return {c["name"].decode(): int(c["pending"]) for c in info.get("consumers", [])}

    def engine_stats(self) -> dict[str, dict[str, Any]]:
        r = self.redis()
        return {
            i.decode(): orjson.loads(v)["stats"]
            for i in r.smembers(Keys("wsllm").engines)
            if (v := r.get(Keys("wsllm").engine(i.decode())))
        }

    def stop(self) -> None:
        for p in [*self.gateways.values(), *self.engines.values()]:
            p.stop()


@dataclass
class Deployment:
    """An engine worker and gateway A in this process (their state can be inspected),
    gateway B a `wsllm gateway` child process (its memory can be measured), on one Redis."""

    a: str  # gateway A's base URL (in this process)
    b: str  # gateway B's base URL (a child process)
    app_a: Any
    worker: Any  # the EngineWorker stepping `engine`
    engine: Any
    cluster: Cluster
    model: str
    grace_s: float  # gateway A's --resume-grace-s

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


def _one_then_a_cluster(request: Any, redis_server: Any) -> Any:
    """The session's redis-server, then its 3-master Redis Cluster."""
    return redis_server if request.param == "one" else request.getfixturevalue("redis_cluster")


#: A module that imports this (an import that ruff's F401 must be told is used) runs
#: every test that takes `redis_server` on one instance, then on the cluster.
on_one_and_on_a_cluster = pytest.fixture(scope="module", params=["one", "cluster"], name="redis_server")(
    _one_then_a_cluster
)


def redis_client(url: str) -> Any:
    """A blocking client of one Redis or of a cluster (`redis+cluster://`)."""
    return sync_client(url, RedisConfig()) if is_cluster(url) else redis.Redis.from_url(url)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisClusterServer:
    """Three `redis-server --cluster-enabled yes` masters on free ports, joined by
    `redis-cli --cluster create` (no replicas), no persistence; `url` names all three
    (`redis+cluster://...`). `client()` is a cluster client: FLUSHALL, KEYS and SCAN
    go to every master."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = workdir
        self.ports = [_cluster_port() for _ in range(masters)]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 20.0) -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert exe and cli, "redis-server and redis-cli are needed (sudo apt-get install -y redis-server)"
        for port in self.ports:
            d = self.workdir / str(port)
            d.mkdir(parents=True, exist_ok=True)
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
                    "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file",
                    str(d / "nodes.conf"), "--cluster-node-timeout", "5000", "--loglevel", "warning"]  # fmt: skip
            with open(d / "redis.log", "ab") as log:
                self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for port in self.ports:
            self._until(deadline, lambda p=port: redis.Redis(port=p, socket_connect_timeout=0.5).ping())
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)  # fmt: skip

        def ready() -> bool:
            for p in self.ports:
                info = redis.Redis(port=p).cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) < len(
                    self.ports
                ):
                    return False
            return True

        self._until(deadline, ready)

    def _until(self, deadline: float, check: Any) -> None:
        while True:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if check():
                    return
            assert all(p.poll() is None for p in self.procs), f"a redis-server exited; see {self.workdir}"
            assert time.monotonic() < deadline, "the Redis Cluster did not come up"
            time.sleep(0.05)

    def client(self) -> Any:
        return redis_client(self.url)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(10)
        self.procs = []


# -- clients ------------------------------------------------------------------------------


@dataclass
class Result:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # error code
    error_message: str = ""
    request_id: str | None = None
    last_event_id: int = 0
    seqs: list[int] = field(default_factory=list)
    ended_at: float = 0.0


async def sse_completion(http: httpx.AsyncClient, base: str, body: dict[str, Any]) -> Result:
    res = Result()
    async with http.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        await read_sse(r, res)
    return res


async def sse_text(base: str, body: dict[str, Any]) -> Result:
    """One streamed completion on a fresh client, read to its end."""
    async with httpx.AsyncClient(timeout=120) as http:
        return await sse_completion(http, base, body)


async def read_sse(r: httpx.Response, res: Result, stop_after: int | None = None) -> Result:
    """Read SSE events into `res`; return after `stop_after` events (None: to the end)."""
    n = 0
    async for line in r.aiter_lines():
        if line.startswith("id: "):
            res.last_event_id = int(line[4:])
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            res.error, res.error_message = chunk["error"]["code"], chunk["error"]["message"]
            continue
        res.request_id = chunk["id"]
        for c in chunk["choices"]:
            res.text += c.get("text", "")
            res.finish_reason = c["finish_reason"] or res.finish_reason
        n += 1
        if stop_after is not None and n >= stop_after:
            return res
    res.ended_at = time.monotonic()
    return res


async def ws_messages(ws: Any, until: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Messages until `until(msg)` is true (inclusive)."""
    out: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = orjson.loads(await ws.recv())
                out.append(msg)
                if until(msg):
                    return out
    except TimeoutError:
        raise AssertionError(
            f"no end after {timeout}s; got {len(out)} messages, the last: {out[-3:]}"
        ) from None


def ws_url(base: str) -> str:
    return base.replace("http", "ws", 1) + "/v1/ws"


async def ws_run(base: str, msg: dict[str, Any]) -> list[dict[str, Any]]:
    """One request on a fresh socket, to its done or error."""
    async with websockets.connect(ws_url(base)) as ws:
        await ws.recv()  # hello
        await ws.send(orjson.dumps(msg).decode())
        return await ws_messages(ws, lambda m: m["type"] in ("done", "error") and m.get("id") == msg["id"])


def joined(msgs: list[dict[str, Any]]) -> str:
    return "".join(m["text"] for m in msgs if m["type"] == "delta")
