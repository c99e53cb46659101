"""The `wsllm` command.

- `serve`: the engines (one per `--model`), the memory broker and the gateway in one
  process; with `--broker redis://...` (or `--redis-url`), engine child processes and
  the gateway, joined by Redis.
- `gateway`: a gateway on Redis. It needs its `--model`s' tokenizers, not their
  weights (a model directory is read as is; other sources go through the loader); the
  other models live engines serve come with the tokenizers those engines publish.
- `engine`: an engine worker on Redis. SIGTERM drains it: it stops pulling, finishes
  its requests for up to `--drain-timeout-s`, hands the rest back, and exits.

Subcommands are data: each names the config dataclasses its flags come from (one
flag per field, `WSLLM_*` env vars as fallback) and a function to run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from wsllm import loadgen
from wsllm.config import EngineConfig, add_arguments, from_args
from wsllm.config_gateway import GatewayConfig
from wsllm.config_process import LogConfig, ModelRefConfig
from wsllm.config_redis import RedisConfig, redacted

log = logging.getLogger("wsllm")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from wsllm.broker.memory import MemoryBroker
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.watchdog import EXIT_STALLED, Watchdog
    from wsllm.engine.worker import EngineWorker
    from wsllm.models.loader import model_name_for, release_freed_heap
    from wsllm.server.app import create_app, uvicorn_config

    ecfg, gcfg, rcfg, mcfg, lcfg = _configs(
        args, EngineConfig, GatewayConfig, RedisConfig, ModelRefConfig, LogConfig
    )
    if not _keys_ok(gcfg):
        return 2
    if rcfg.uses_redis:
        return _serve_redis(ecfg, gcfg, rcfg, mcfg, lcfg)
    broker = MemoryBroker(max_queue_depth=gcfg.max_queue_depth, max_queue_share=gcfg.max_queue_share)
    models = mcfg.model or [None]
    workers: list[EngineWorker] = []
    stalled: list[Any] = []  # the server, then why an engine stalled: it stops, exiting EXIT_STALLED
    on_stall = lambda why: (stalled.append(why), setattr(stalled[0], "should_exit", True))  # noqa: E731
    try:
        for m in models:  # one engine per model, each on its own thread
            name = mcfg.served_name or model_name_for(m)
            ecfg_m = dataclasses.replace(ecfg, model=m)

            def build(c: EngineConfig = ecfg_m, name: str = name) -> LLMEngine:
                llm = LLMEngine.from_config(c)
                llm.model_name = name
                llm.matchers.warm()  # structured output's index, off the engine thread
                return llm

            side = broker.engine_side(name) if len(models) > 1 else broker
            # loaded on the thread that runs it: see EngineWorker.spawn
            workers.append(EngineWorker.spawn(build, side, aliases=mcfg.aliases))
        engines = [cast(LLMEngine, w.engine) for w in workers]
        dirs = {e.model_name: Path(e.model_dir) for e in engines}
        app = create_app(gcfg, broker, engines[0].model_dir, engines[0].model_name, tokenizer_dirs=dirs)
        release_freed_heap()  # the tokenizers' load temporaries: ~30 MB resident otherwise
        server = uvicorn.Server(uvicorn_config(app, gcfg, log_level=lcfg.log_level))
        stalled.append(server)
        for w in workers:
            Watchdog(w, ecfg.stall_timeout_s, on_stall, ecfg.stall_factor).start()
        host = "localhost" if gcfg.host in ("0.0.0.0", "::") else gcfg.host
        print(f"wsllm: serving {', '.join(dirs)} at http://{host}:{gcfg.port}/", flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once it has shut down
            server.run()
    finally:
        for w in workers:
            if not w.stalled:  # a stuck one never stops: the process exits around it
                w.stop()
        broker.close()
    if len(stalled) > 1:  # a stuck engine thread: no interpreter teardown around it (see _exit_now)
        _exit_now(EXIT_STALLED, f"exiting: {stalled[1]}")
    return 0


def _configs(args: argparse.Namespace, *classes: type) -> tuple[Any, ...]:
    return tuple(from_args(cls, args) for cls in classes)


def _run_gateway(app: Any, gcfg: GatewayConfig, names: list[str], log_level: str) -> None:
    import uvicorn

    from wsllm.server.app import uvicorn_config

    server = uvicorn.Server(uvicorn_config(app, gcfg, log_level=log_level))
    host = "localhost" if gcfg.host in ("0.0.0.0", "::") else gcfg.host
    print(f"wsllm: serving {', '.join(names)} at http://{host}:{gcfg.port}/", flush=True)
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

    return resolve_model_dir(model, weights=False), name or model_name_for(model)  # the tokenizer only


def _gateway_app(gcfg: GatewayConfig, mcfg: ModelRefConfig, broker: Any) -> tuple[Any, list[str]]:
    """The gateway app: the first --model is the default (requests that name no
    model), every --model's tokenizer is read here; other models the engines serve
    are found in the registry, their tokenizers in what their engines published."""
    from wsllm.server.app import create_app

    found = [_tokenizer_and_name(m, mcfg.served_name) for m in (mcfg.model or [None])]
    dirs = {name: path for path, name in found}
    return create_app(gcfg, broker, found[0][0], found[0][1], tokenizer_dirs=dirs), list(dirs)


def gateway(args: argparse.Namespace) -> int:
    from wsllm.broker.redis_gateway import RedisGateway

    gcfg, rcfg, mcfg, lcfg = _configs(args, GatewayConfig, RedisConfig, ModelRefConfig, LogConfig)
    if not _keys_ok(gcfg):
        return 2
    default = mcfg.served_name or _tokenizer_and_name((mcfg.model or [None])[0], None)[1]
    broker = RedisGateway(
        rcfg.url(),
        model=default,
        cfg=rcfg,
        max_queue_depth=gcfg.max_queue_depth,
        max_queue_share=gcfg.max_queue_share,
    )
    try:
        app, names = _gateway_app(gcfg, mcfg, broker)
        _run_gateway(app, gcfg, names, lcfg.log_level)
    finally:
        broker.close()
    return 0


def engine(args: argparse.Namespace) -> int:
    from wsllm.broker.base import read_tokenizer_files
    from wsllm.broker.redis_engine import RedisEngine
    from wsllm.engine.watchdog import Watchdog
    from wsllm.engine.worker import EngineWorker

    ecfg, rcfg, mcfg = _configs(args, EngineConfig, RedisConfig, ModelRefConfig)
    if len(mcfg.model) > 1:
        print("wsllm: an engine serves one --model (start one engine per model)", file=sys.stderr)
        return 2
    llm = _build_engine(ecfg, mcfg)
    # what is loaded out of the collector's full walks, as the app does when it starts serving
    # (server/app.py, freeze_startup_heap: importing it would load the whole gateway here)
    gc.collect()
    gc.freeze()
    engine_id = rcfg.engine_id or f"{socket.gethostname()}-{os.getpid()}"
    url = rcfg.url()
    broker = RedisEngine(url, model=llm.model_name, cfg=rcfg, engine_id=engine_id)
    # every gateway can then serve this model without the files on its own disk
    broker.publish_tokenizer(llm.model_name, read_tokenizer_files(llm.model_dir))
    worker = EngineWorker(
        llm, broker, engine_id=engine_id, heartbeat_s=rcfg.engine_heartbeat_s, aliases=mcfg.aliases
    )

    def on_signal(signum: int, frame: Any) -> None:
        if worker.draining:  # a second signal: hand everything back now
            worker.drain_gracefully(0.0)
            return
        log.info("signal %d: draining (up to %.0fs), then exiting", signum, rcfg.drain_timeout_s)
        worker.drain_gracefully(rcfg.drain_timeout_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"wsllm: engine {engine_id} serving {llm.model_name} from {redacted(url)}", flush=True)
    Watchdog(worker, ecfg.stall_timeout_s, _exit_stalled(broker, engine_id), ecfg.stall_factor).start()
    try:
        worker.run()
    finally:
        broker.close()
    return 0


def _exit_stalled(broker: Any, engine_id: str) -> Callable[[str], None]:
    """Once the watchdog handed a stuck engine's requests back: leave the registry and
    exit now, for the supervisor to start a fresh one (a stuck thread cannot be stopped)."""
    from wsllm.engine.watchdog import EXIT_STALLED

    def exit_now(reason: str) -> None:
        broker.deregister(engine_id)
        _exit_now(EXIT_STALLED, f"exiting: {reason}")

    return exit_now


def _exit_now(status: int, why: str) -> None:
    """Exit with `status` now, past the interpreter's teardown: a thread stuck in the
    engine's native code would meet its libraries' destructors (a C++ runtime then aborts
    the process, "terminate called without an active exception": SIGABRT, not `status`)."""
    print(f"wsllm: {why}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    logging.shutdown()
    os._exit(status)


def _build_engine(ecfg: EngineConfig, mcfg: ModelRefConfig) -> Any:
    """`wsllm engine`'s engine: the model's, or with --fake-step-ms a fake one that needs
    only the model's tokenizer (no torch, no weights), for load tests of the broker."""
    model = (mcfg.model or [None])[0]
    if ecfg.fake_step_ms is not None:
        from wsllm.engine.fake import FakeEngine

        path, name = _tokenizer_and_name(model, mcfg.served_name)
        n_seqs, n_wait, ctx = ecfg.max_num_seqs, ecfg.max_waiting, ecfg.max_model_len
        return FakeEngine(
            path, name, ecfg.fake_step_ms, max_num_seqs=n_seqs, max_waiting=n_wait, max_model_len=ctx
        )
    from wsllm.engine.engine import LLMEngine

    llm = LLMEngine.from_config(dataclasses.replace(ecfg, model=model))
    if mcfg.served_name:
        llm.model_name = mcfg.served_name
    llm.matchers.warm()  # structured output's index, off the engine thread
    return llm


def _serve_redis(
    ecfg: EngineConfig, gcfg: GatewayConfig, rcfg: RedisConfig, mcfg: ModelRefConfig, lcfg: LogConfig
) -> int:
    """`wsllm serve --broker redis://...`: one engine child process per model, supervised
    (restarted when it exits: wsllm/supervisor.py), and the gateway here, which starts
    serving once every engine has registered (as `serve` does in memory) and answers
    /health with 503 while a child is down."""
    from wsllm.broker.redis_gateway import RedisGateway
    from wsllm.supervisor import Supervisor, engine_child

    url = rcfg.url()
    children = []
    for i, m in enumerate(mcfg.model or [None]):
        engine_id = rcfg.engine_id or f"{socket.gethostname()}-serve-{os.getpid()}"
        engine_id += f"-{i}" if len(mcfg.model) > 1 else ""
        one = dataclasses.replace(mcfg, model=[m] if m else [])
        children.append(engine_child(url, dataclasses.replace(rcfg, engine_id=engine_id), ecfg, one, lcfg))
    supervisor = Supervisor(url, rcfg, children)
    try:
        default = mcfg.served_name or _tokenizer_and_name((mcfg.model or [None])[0], None)[1]
        broker = RedisGateway(
            url,
            model=default,
            cfg=rcfg,
            max_queue_depth=gcfg.max_queue_depth,
            max_queue_share=gcfg.max_queue_share,
        )
        try:
            if not supervisor.start():
                return 1
            app, names = _gateway_app(gcfg, mcfg, broker)
            app.state.process_health = supervisor.unhealthy
            supervisor.watch()
            _run_gateway(app, gcfg, names, lcfg.log_level)
        finally:
            broker.close()
    finally:
        supervisor.stop()
    return 0


@dataclass(frozen=True)
class Command:
    help: str
    configs: tuple[type, ...]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "run the engines and the gateway in one process (--broker redis://...: engine child processes)",
        (ModelRefConfig, EngineConfig, GatewayConfig, RedisConfig, LogConfig),
        serve,
    ),
    "gateway": Command(
        "a gateway on Redis (no model weights)",
        (ModelRefConfig, GatewayConfig, RedisConfig, LogConfig),
        gateway,
    ),
    "engine": Command(
        "an engine worker on Redis", (ModelRefConfig, EngineConfig, RedisConfig, LogConfig), engine
    ),
    "bench": Command(
        "load-test a server (OpenAI SSE or wsllm WS)", (loadgen.BenchConfig, LogConfig), loadgen.run
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsllm", description="LLM serving over WebSockets and SSE")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help)
        for cls in cmd.configs:
            add_arguments(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        level = from_args(LogConfig, args).log_level
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
