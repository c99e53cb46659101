"""The child processes of bench/broker_scale.py.

- `engines`: several fake engines in one process, one thread each, every one the real
  `EngineWorker` loop over its own `RedisBroker` (its own connections, engine id and
  heartbeat) and a `FakeEngine` (wsllm/engine/fake.py). A `wsllm engine` process costs
  about 80 MB, and 64 of them would crowd a small machine; threads share one
  interpreter, and since a fake step is a sleep and Redis calls wait on sockets, the GIL
  is free most of the time. What is measured (the broker's commands) is the same.
- `load`: one asyncio load client. Its streams are WebSocket requests, up to `--per-socket`
  on each socket, sockets spread over the gateways and requests over the model names;
  each stream is a closed loop (a request, read to its `done`, then the next) until
  the run's end. Every request's send, first delta and end times and its completion
  tokens go to a JSON file, with the tokens received in each wall-clock second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("broker_scale")


# -- fake engines ---------------------------------------------------------------------------


def run_engines(args: argparse.Namespace) -> None:
    from wsllm.broker.base import read_tokenizer_files
    from wsllm.broker.redis import RedisBroker
    from wsllm.config_redis import RedisConfig
    from wsllm.engine.fake import FakeEngine
    from wsllm.engine.worker import EngineWorker

    names = args.names.split(",")
    cfg = RedisConfig(broker=args.url, engine_heartbeat_s=1.0, engine_ttl_s=10.0)
    files = read_tokenizer_files(args.model_dir)
    workers: list[Any] = []
    brokers: list[Any] = []
    for k in range(args.count):
        index = args.first + k
        name = names[index % len(names)]
        engine = FakeEngine(Path(args.model_dir), name, args.step_ms, max_num_seqs=args.max_num_seqs)
        broker = RedisBroker(args.url, model=name, cfg=cfg, engine_id=f"fake-{index}")
        if index < len(names):  # one engine per model publishes its tokenizer for the gateways
            broker.publish_tokenizer(name, files)
        brokers.append(broker)
        workers.append(
            EngineWorker(engine, broker, engine_id=f"fake-{index}", heartbeat_s=cfg.engine_heartbeat_s)
        )
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    for w in workers:
        w.start()
    done.wait()
    for w in workers:  # stop pulling, hand back what they hold, deregister
        w.drain_gracefully(0.0)
    deadline = time.monotonic() + 10  # a Redis already gone must not keep this process
    for w in workers:
        with contextlib.suppress(Exception):
            w.stop(max(0.1, deadline - time.monotonic()))
    for b in brokers:
        with contextlib.suppress(Exception):
            b.close()


# -- the load client ------------------------------------------------------------------------


class Socket:
    """One WebSocket with up to `streams` requests in flight, each restarted on its end."""

    def __init__(self, client: Load, url: str, streams: int, first: int) -> None:
        self.client, self.url, self.streams, self.first = client, url, streams, first
        self.inflight: dict[str, list[float]] = {}  # id -> [sent, first delta, last delta]
        self.n = 0

    async def _send(self, ws: Any) -> None:
        c = self.client
        rid = f"{self.first}-{self.n}"
        model = c.names[(self.first + self.n) % len(c.names)]
        self.n += 1
        msg = {
            "type": "completion",
            "id": rid,
            "model": model,
            "prompt": c.prompt,
            "max_tokens": c.max_tokens,
        }
        self.inflight[rid] = [time.time(), 0.0, 0.0]
        await ws.send(orjson.dumps(msg).decode())

    async def run(self) -> None:
        import websockets

        c = self.client
        async with websockets.connect(
            self.url, ping_interval=None, max_size=1 << 22, open_timeout=60, close_timeout=1
        ) as ws:
            await ws.recv()  # hello
            for _ in range(self.streams):
                await self._send(ws)
            async for raw in ws:
                m = orjson.loads(raw)
                kind, rid = m["type"], m.get("id")
                rec = self.inflight.get(rid) if rid else None
                if rec is None:
                    continue
                if kind == "delta":
                    now = time.time()
                    if rec[1]:  # the wait since this request's previous delta
                        c.gaps.append((now, now - rec[2]))
                    else:  # its first token's
                        rec[1] = now
                        c.ttfts.append((now, now - rec[0]))
                    rec[2] = now
                    # Tokens as they arrive, not only at a request's end: under overload few
                    # requests end within the window. Every token of the fake's sentence is
                    # a word with its leading space or the full stop (wsllm/engine/fake.py).
                    text = m["text"]
                    sec = int(now)
                    c.tokens_by_s[sec] = c.tokens_by_s.get(sec, 0) + text.count(" ") + text.count(".")
                elif kind in ("done", "error"):
                    del self.inflight[rid]
                    tokens = m["usage"]["completion_tokens"] if kind == "done" else 0
                    c.results.append((rec[0], rec[1], time.time(), tokens, m.get("code")))
                    if time.time() < c.stop_at:
                        await self._send(ws)
                    elif not self.inflight:
                        return


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.names = args.names.split(",")
        self.prompt = [1000 + i for i in range(args.prompt_tokens)]
        self.max_tokens = args.max_tokens
        self.stop_at = time.time() + args.run_s
        self.results: list[tuple[float, float, float, int, str | None]] = []
        self.failures: list[str] = []
        self.tokens_by_s: dict[int, int] = {}  # wall-clock second -> tokens received in it
        self.ttfts: list[tuple[float, float]] = []  # (when, seconds from send to the first delta)
        self.gaps: list[tuple[float, float]] = []  # (when, seconds since the request's previous delta)

    async def run(
        self, gateways: list[str], streams: int, per_socket: int, first: int, ramp_s: float
    ) -> None:
        sockets = []
        k = 0
        while k < streams:
            n = min(per_socket, streams - k)
            url = gateways[len(sockets) % len(gateways)].replace("http", "ws", 1) + "/v1/ws"
            sockets.append(Socket(self, url, n, first + k))
            k += n
        tasks = []
        for s in sockets:  # connect over `ramp_s`, not all in one burst
            tasks.append(asyncio.create_task(self._guarded(s)))
            await asyncio.sleep(ramp_s / len(sockets))
        # At the end, leave: what is still in flight is cancelled by the gateways as
        # clients that went away. Waiting for it would measure the drain, not the load.
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, self.stop_at - time.time()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _guarded(self, s: Socket) -> None:
        try:
            await s.run()
        except Exception as e:  # a socket that breaks is reported, the others go on
            self.failures.append(f"{s.url}: {type(e).__name__}: {e}")


def run_load(args: argparse.Namespace) -> None:
    load = Load(args)
    asyncio.run(
        load.run(args.gateway_urls.split(","), args.streams, args.per_socket, args.first, args.ramp_s)
    )
    out = {
        "results": load.results,
        "failures": load.failures[:20],
        "tokens_by_s": load.tokens_by_s,
        "ttfts": load.ttfts,
        "gaps": load.gaps,
    }
    Path(args.out).write_bytes(orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS))


def add_child_arguments(p: argparse.ArgumentParser) -> None:
    """The flags the parent passes to its children (hidden from --help)."""
    for flag, kind in (
        ("--role", str), ("--url", str), ("--model-dir", str), ("--names", str), ("--count", int),
        ("--first", int), ("--gateway-urls", str), ("--run-s", float), ("--out", str), ("--ramp-s", float),
    ):  # fmt: skip
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
