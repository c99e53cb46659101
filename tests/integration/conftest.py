"""A real gateway on a free port: uvicorn in a background thread, the engine worker
in another, joined by the memory broker, exactly as `wsllm serve` runs them.

    with live_server(engine, api_key="k") as srv:
        srv.base_url, srv.ws_url, srv.engine, srv.worker, srv.gateway

Engines are loaded once per session. One engine serves one live server at a time
(the engine is not thread-safe); servers are module-scoped, so modules take turns.
`redis_deployment` is the same on Redis, with a second gateway in a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from redis_fixtures import Cluster, Deployment

from wsllm.broker.memory import MemoryBroker
from wsllm.broker.redis import RedisBroker
from wsllm.config import EngineConfig
from wsllm.config_gateway import GatewayConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.server.app import create_app, uvicorn_config
from wsllm.server.gateway import Gateway

_busy: set[int] = set()  # id() of engines serving right now


@dataclass
class LiveServer:
    base_url: str
    ws_url: str
    engine: Any
    worker: EngineWorker
    broker: MemoryBroker
    gateway: Gateway
    cfg: GatewayConfig

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent)."""
        headers = {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        text = httpx.get(f"{self.base_url}/metrics", headers=headers).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                sample, value = line.rsplit(" ", 1)
                got = sample[len(name) :].strip("{}")
                if all(part in got.split(",") for part in want.split(",") if part):
                    total += float(value)
        return total

    def wait_gateway_forgot(self, request_id: str | None = None, timeout: float = 10.0) -> None:
        """Until the gateway follows `request_id` (or any request) no more. It drops a
        request only after its abort is with the broker."""

        def following() -> bool:
            ids = self.gateway.router.request_ids()
            return bool(ids) if request_id is None else request_id in ids

        deadline = time.monotonic() + timeout
        while following():
            assert time.monotonic() < deadline, "the gateway still follows the request"
            time.sleep(0.002)

    def assert_engine_forgot(self, request_id: str) -> None:
        """Once the gateway sent the abort, the engine drops the request within one
        step: the step in flight may finish; the next one starts without it."""
        self.wait_gateway_forgot(request_id)
        start = self.worker.steps
        deadline = time.monotonic() + 30
        # An idle engine takes no steps, and holds nothing either.
        while self.worker.steps < start + 2 and self.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine took no step in 30 s"
            time.sleep(0.001)
        assert not self.engine.is_known(request_id)

    def engine_stats(self) -> dict[str, Any]:
        """The engine's stats from its latest heartbeat (taken on the worker thread)."""
        (info,) = asyncio.run(self.broker.engines())
        return info.stats

    def assert_no_blocks_held(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine_stats()
            idle = s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0
            if idle and s["num_free_blocks"] == s["num_total_blocks"]:
                return
            assert time.monotonic() < deadline, f"the engine still holds blocks: {s}"
            time.sleep(0.02)


@contextlib.contextmanager
def run_uvicorn(
    app_for: Callable[[GatewayConfig], Any], cfg: GatewayConfig, **uvicorn_overrides: Any
) -> Iterator[tuple[str, Any]]:
    """uvicorn in a thread on a free port; `app_for(cfg)` builds the app once the port is
    known. Yields (base_url, app)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    cfg = dataclasses.replace(cfg, host="127.0.0.1", port=port)
    app = app_for(cfg)
    server = uvicorn.Server(uvicorn_config(app, cfg, **({"log_level": "warning"} | uvicorn_overrides)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _serve_on(engine: Any, cfg: GatewayConfig) -> Iterator[LiveServer]:
    if id(engine) in _busy:
        raise RuntimeError("this engine already serves another live server; use module-scoped servers")
    _busy.add(id(engine))
    broker = MemoryBroker(max_queue_depth=cfg.max_queue_depth)
    worker = EngineWorker(engine, broker, heartbeat_s=0.1)
    worker.start()
    try:
        with run_uvicorn(lambda c: create_app(c, broker, engine.model_dir, engine.model_name), cfg) as (
            base,
            app,
        ):
            _wait_ready(base, cfg.api_key)
            gw = app.state.gateway
            yield LiveServer(base, base.replace("http", "ws") + "/v1/ws", engine, worker, broker, gw, gw.cfg)
    finally:
        worker.stop()
        broker.close()
        _busy.discard(id(engine))
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert stats.num_free_blocks == stats.num_total_blocks, f"KV blocks leaked: {stats}"


def _wait_ready(base: str, api_key: str | None, timeout: float = 30.0) -> None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", headers=headers, timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{base} did not become ready in {timeout}s")


@pytest.fixture(scope="session")
def live_server() -> Callable[..., contextlib.AbstractContextManager[LiveServer]]:
    """`live_server(engine, **GatewayConfig overrides)`: a context manager."""

    @contextlib.contextmanager
    def serve(engine: Any, **overrides: Any) -> Iterator[LiveServer]:
        yield from _serve_on(engine, GatewayConfig(**overrides))

    return serve


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Any:
    from wsllm.engine.engine import LLMEngine

    # 2048 tokens of KV per sequence for 64 sequences is plenty for these tests. fp32 on
    # every CPU: bf16 (auto where the CPU has it) rounds near-ties differently per batch.
    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=2048, max_num_seqs=64, dtype="float32")
    )


@pytest.fixture(scope="session")
def smollm_engine(smollm_llm: Any) -> Any:
    """The session's SmolLM2 engine (shared with the LLM fixture: load it once)."""
    return smollm_llm.engine


@pytest.fixture(scope="module")
def tiny_server(live_server: Any, tiny_engine: Any) -> Iterator[LiveServer]:
    with live_server(tiny_engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_openai(tiny_server: LiveServer) -> openai.OpenAI:
    """The official client on `tiny_server`."""
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def uvicorn_thread() -> Callable[..., contextlib.AbstractContextManager[tuple[str, Any]]]:
    """`run_uvicorn` for tests that build their own app (no engine behind it)."""
    return run_uvicorn


# Gateway B's limits: a client that never reads is dropped in 2 s, its pings notwithstanding.
GATEWAY_B_FLAGS = ["--send-timeout-s", "2", "--heartbeat-s", "60", "--max-buffered-events", "1024"]


@pytest.fixture(scope="module")
def redis_deployment(
    redis_server: Any, tiny_engine: Any, tiny_model_dir: Path, uvicorn_thread: Any, tmp_path_factory: Any
) -> Iterator[Deployment]:
    """The tiny engine's worker and gateway A in this process, gateway B a child process,
    on the session's (flushed) Redis. Module-scoped: the engine serves one module at a time."""
    redis_server.client().flushall()
    model = tiny_model_dir.name
    assert tiny_engine.model_name == model
    if id(tiny_engine) in _busy:
        raise RuntimeError("the tiny engine already serves a live server; use module-scoped fixtures")
    grace_s = 1.0
    rcfg = RedisConfig(resume_grace_s=grace_s, stream_retention_s=30, engine_ttl_s=5)
    engine_side = RedisBroker(redis_server.url, model=model, cfg=rcfg, engine_id="engine-h")
    worker = EngineWorker(tiny_engine, engine_side, engine_id="engine-h", heartbeat_s=0.2)
    worker.start()
    gateway_a = RedisBroker(redis_server.url, model=model, cfg=rcfg)
    cluster = Cluster(redis_server.url, tiny_model_dir, tmp_path_factory.mktemp("deployment-logs"))
    _busy.add(id(tiny_engine))
    try:
        cluster.start_gateway(*GATEWAY_B_FLAGS)
        app_for = lambda c: create_app(c, gateway_a, tiny_model_dir, model)  # noqa: E731
        with uvicorn_thread(app_for, GatewayConfig(frontend=False)) as (a, app):
            cluster.wait_ready(1)
            yield Deployment(a, cluster.urls[0], app, worker, tiny_engine, cluster, model, grace_s)
    finally:
        cluster.stop()
        worker.stop()
        gateway_a.close()
        engine_side.close()
        _busy.discard(id(tiny_engine))
