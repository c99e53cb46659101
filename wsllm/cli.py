"""`wsllm serve`: the engine, the memory broker and the gateway in one process.

Subcommands are data: each names the config dataclasses its flags come from (one
flag per field, `WSLLM_*` env vars as fallback) and a function to run. The Redis
deployment adds `gateway` and `engine` here."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from wsllm import loadgen
from wsllm.config import EngineConfig, GatewayConfig, add_arguments, from_args

log = logging.getLogger("wsllm")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from wsllm.broker.memory import MemoryBroker
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker
    from wsllm.server.app import create_app, uvicorn_config

    ecfg = from_args(EngineConfig, args)
    gcfg = from_args(GatewayConfig, args)
    if gcfg.broker != "memory":
        print(
            "wsllm serve runs everything in one process with the memory broker; "
            f"--broker {gcfg.broker} is for separate gateway and engine processes",
            file=sys.stderr,
        )
        return 2
    engine = LLMEngine.from_config(ecfg)
    broker = MemoryBroker(max_pending=gcfg.max_queue_depth)
    worker = EngineWorker(engine, broker)
    worker.start()
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


@dataclass(frozen=True)
class Command:
    help: str
    configs: tuple[type, ...]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "serve": Command("run the engine and the gateway in one process", (EngineConfig, GatewayConfig), serve),
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
