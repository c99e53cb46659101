"""The `wsllm` command.

- `serve`: the engine, the memory broker and the gateway in one process; with
  `--redis-url` (or `--broker redis://...`), an engine child process and the gateway,
  joined by Redis.
- `gateway`: a gateway on Redis. It needs the model's tokenizer and name, not its
  weights (a model directory is read as is; other sources go through the loader).
- `engine`: an engine worker on Redis. SIGTERM drains it: it stops pulling, finishes
  its requests for up to `--drain-timeout-s`, hands the rest back, and exits.

Subcommands are data: each names the config dataclasses its flags come from (one
flag per field, `WSLLM_*` env vars as fallback) and a function to run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from wsllm import loadgen
from wsllm.config import (
    EngineBrokerConfig,
    EngineConfig,
    GatewayConfig,
    ModelRefConfig,
    RedisConfig,
    add_arguments,
    from_args,
)

log = logging.getLogger("wsllm")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from wsllm.broker.memory import MemoryBroker
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker
    from wsllm.server.app import create_app, uvicorn_config

    ecfg = from_args(EngineConfig, args)
    gcfg = from_args(GatewayConfig, args)
    rcfg = from_args(RedisConfig, args)
    if not _keys_ok(gcfg):
        return 2
    if rcfg.redis_url or gcfg.broker != "memory":
        return _serve_redis(args, ecfg, gcfg, rcfg)
    broker = MemoryBroker(max_pending=gcfg.max_queue_depth)
    # loaded on the thread that runs it: see EngineWorker.spawn
    worker = EngineWorker.spawn(lambda: LLMEngine.from_config(ecfg), broker)
    engine = cast(LLMEngine, worker.engine)
    try:
        app = create_app(gcfg, broker, engine.model_dir, engine.model_name)
        server = uvicorn.Server(uvicorn_config(app, gcfg))
        host = "localhost" if gcfg.host in ("0.0.0.0", "::") else gcfg.host
        print(f"wsllm: serving {engine.model_name} at http://{host}:{gcfg.port}/", flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once it has shut down
            server.run()
    finally:
        worker.stop()
        broker.close()
    return 0


def _run_gateway(app: Any, gcfg: GatewayConfig, model_name: str) -> None:
    import uvicorn

    from wsllm.server.app import uvicorn_config

    server = uvicorn.Server(uvicorn_config(app, gcfg))
    host = "localhost" if gcfg.host in ("0.0.0.0", "::") else gcfg.host
    print(f"wsllm: serving {model_name} at http://{host}:{gcfg.port}/", flush=True)
    # uvicorn shuts down on SIGTERM, then raises the signal again with the handler it found:
    # make that an interrupt, so that the caller's clean-up (engine child, broker) runs.
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once it has shut down
        server.run()


def _keys_ok(gcfg: GatewayConfig) -> bool:
    """Check --api-keys-file before anything slow starts; a bad one is a clear error."""
    from wsllm.server.tenants import Tenants

    try:
        Tenants.from_settings(gcfg.api_key, gcfg.api_keys_file)
    except ValueError as e:
        print(f"wsllm: {e}", file=sys.stderr)
        return False
    return True


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _tokenizer_and_name(model: str | None, name: str | None) -> tuple[Path, str]:
    """The model's tokenizer directory and served name, as the engine names it. A
    local directory is used as it is (no torch in the gateway process)."""
    if model and Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
        return path, name or path.name
    from wsllm.models.loader import model_name_for, resolve_model_dir

    return resolve_model_dir(model), name or model_name_for(model)


def gateway(args: argparse.Namespace) -> int:
    from wsllm.broker.redis import RedisBroker
    from wsllm.server.app import create_app

    gcfg = from_args(GatewayConfig, args)
    rcfg = from_args(RedisConfig, args)
    if not _keys_ok(gcfg):
        return 2
    tokenizer_dir, name = _tokenizer_and_name(from_args(ModelRefConfig, args).model, gcfg.model_name)
    broker = RedisBroker(rcfg.url(gcfg.broker), model=name, cfg=rcfg, max_pending=gcfg.max_queue_depth)
    try:
        _run_gateway(create_app(gcfg, broker, tokenizer_dir, name), gcfg, name)
    finally:
        broker.close()
    return 0


def engine(args: argparse.Namespace) -> int:
    from wsllm.broker.redis import RedisBroker
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker

    ecfg = from_args(EngineConfig, args)
    bcfg = from_args(EngineBrokerConfig, args)
    rcfg = from_args(RedisConfig, args)
    llm = LLMEngine.from_config(ecfg)
    if bcfg.model_name:
        llm.model_name = bcfg.model_name
    engine_id = rcfg.engine_id or f"{socket.gethostname()}-{os.getpid()}"
    url = rcfg.url(bcfg.broker)
    broker = RedisBroker(url, model=llm.model_name, cfg=rcfg, engine_id=engine_id)
    worker = EngineWorker(llm, broker, engine_id=engine_id, heartbeat_s=rcfg.engine_heartbeat_s)

    def on_signal(signum: int, frame: Any) -> None:
        if worker.draining:  # a second signal: hand everything back now
            worker.drain_gracefully(0.0)
            return
        log.info("signal %d: draining (up to %.0fs), then exiting", signum, rcfg.drain_timeout_s)
        worker.drain_gracefully(rcfg.drain_timeout_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"wsllm: engine {engine_id} serving {llm.model_name} from {_redacted(url)}", flush=True)
    try:
        worker.run()
    finally:
        broker.close()
    return 0


def _redacted(url: str) -> str:
    head, at, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if at else url


def _serve_redis(args: argparse.Namespace, ecfg: EngineConfig, gcfg: GatewayConfig, rcfg: RedisConfig) -> int:
    """`wsllm serve --redis-url ...`: one engine child process and the gateway here,
    which starts serving once the engine has registered (as `serve` does in memory)."""
    from wsllm.broker.redis import RedisBroker
    from wsllm.server.app import create_app

    url = rcfg.url(gcfg.broker)
    engine_id = rcfg.engine_id or f"{socket.gethostname()}-serve-{os.getpid()}"
    cmd, env = engine_child(url, dataclasses.replace(rcfg, engine_id=engine_id), ecfg, gcfg.model_name)
    cmd[3:3] = ["--log-level", args.log_level]
    child = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    try:
        tokenizer_dir, name = _tokenizer_and_name(ecfg.model, gcfg.model_name)
        broker = RedisBroker(url, model=name, cfg=rcfg, max_pending=gcfg.max_queue_depth)
        try:
            if not _wait_registered(broker, engine_id, child):
                return 1
            _run_gateway(create_app(gcfg, broker, tokenizer_dir, name), gcfg, name)
        finally:
            broker.close()
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(rcfg.drain_timeout_s + 10)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


def engine_child(
    url: str, rcfg: RedisConfig, ecfg: EngineConfig, model_name: str | None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `serve --redis-url`'s engine child. The
    Redis URL (it may hold a password) goes in the environment: a command line is
    readable by every user of the machine (`ps`)."""
    flags = _flags(dataclasses.replace(rcfg, redis_url=None)) + _flags(ecfg)
    if model_name:
        flags += ["--model-name", model_name]
    env = {k: v for k, v in os.environ.items() if k not in ("WSLLM_BROKER", "WSLLM_REDIS_URL")}
    env["WSLLM_REDIS_URL"] = url
    return [sys.executable, "-m", "wsllm", "engine", *flags], env


def _die_with_parent() -> None:
    """In the engine child (Linux): SIGTERM it when this process dies, even by SIGKILL."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _wait_registered(broker: Any, engine_id: str, child: subprocess.Popen[bytes]) -> bool:
    """Until the engine child's heartbeat is in Redis; False if the child exits first."""
    import time

    while child.poll() is None:
        with contextlib.suppress(Exception):  # Redis may still be starting too
            if broker.engine_alive(engine_id):
                return True
        time.sleep(0.2)
    print(f"wsllm: the engine process exited ({child.returncode}) before it registered", file=sys.stderr)
    return False


def _flags(cfg: Any) -> list[str]:
    """CLI flags that rebuild `cfg` (fields left at their defaults are left out)."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


@dataclass(frozen=True)
class Command:
    help: str
    configs: tuple[type, ...]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "run the engine and the gateway in one process (--redis-url: an engine child process)",
        (EngineConfig, GatewayConfig, RedisConfig),
        serve,
    ),
    "gateway": Command(
        "a gateway on Redis (no model weights)", (GatewayConfig, RedisConfig, ModelRefConfig), gateway
    ),
    "engine": Command("an engine worker on Redis", (EngineConfig, EngineBrokerConfig, RedisConfig), engine),
    "bench": Command("load-test a server (OpenAI SSE or wsllm WS)", (loadgen.BenchConfig,), loadgen.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsllm", description="LLM serving over WebSockets and SSE")
    parser.add_argument("--log-level", default="info", help="debug | info | warning | error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help)
        for cls in cmd.configs:
            add_arguments(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
