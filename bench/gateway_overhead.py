"""What the gateway itself costs per streamed token.

A fake engine emits one token per running request every `--pace` seconds (a decode
step at a fixed speed) behind the real worker loop, memory broker and gateway (text
work, SSE and WebSocket). Next to it, in the same run, a bare Starlette endpoint
streams the same bytes on the same clock. For 64 and 256 concurrent streams it
reports delivered tokens/s and the latency from a token's emission to its arrival at
the client (p50/p99), and the gateway's added latency over the bare endpoint.

Each server runs in its own process; the client is a lean asyncio client (raw HTTP
for SSE, `websockets` for WS) in this process. Timestamps are wall-clock times on one
machine.

    python bench/gateway_overhead.py                 # print the table
    python bench/gateway_overhead.py --write-docs    # and put it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import websockets
from tqdm import tqdm

from wsllm.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from wsllm.types import GenerateRequest

ROOT = Path(__file__).resolve().parents[1]
TOKEN_TEXT = " the"  # one token in SmolLM2's vocabulary: each token is 4 characters

# -- server side: the fake engine -------------------------------------------------------------


@dataclass(slots=True)
class _Req:
    prompt: list[int]
    max_tokens: int
    done: int = 0


@dataclass
class FakeEngine:
    """The engine contract the worker uses, emitting `token_id` at a fixed pace."""

    token_id: int
    pace_s: float
    model_name: str = "fake"
    max_model_len: int = 4096
    adapters: Any = None  # it serves no LoRA adapter
    emits: dict[str, list[float]] = field(default_factory=dict)
    _reqs: dict[str, _Req] = field(default_factory=dict)
    _aborted: list[str] = field(default_factory=list)
    _next_step: float = 0.0

    def add_request(self, request: GenerateRequest) -> None:
        self._reqs[request.request_id] = _Req(list(request.prompt_token_ids), request.params.max_tokens)
        self.emits[request.request_id] = []

    def cached_prefix(self) -> tuple[int, list[bytes]]:
        return 0, []  # no prefix cache

    def admission_rank(self) -> Any:
        return lambda priority, tenant: (priority, 0.0)  # first come, first served

    def abort(self, request_id: str) -> bool:
        if self._reqs.pop(request_id, None) is None:
            return False
        self._aborted.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._reqs or self._aborted)

    def free_capacity(self) -> int:
        return 4096 - len(self._reqs)

    def stats(self) -> EngineStats:
        return EngineStats(len(self._reqs), 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0)

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        if now < self._next_step:
            time.sleep(self._next_step - now)
        self._next_step = max(self._next_step + self.pace_s, time.monotonic())
        t = time.time()
        outs = [RequestOutput(rid, 0, [CompletionOutput(0, [], 0, "abort")], True) for rid in self._aborted]
        self._aborted.clear()
        for rid, r in list(self._reqs.items()):
            r.done += 1
            self.emits[rid].append(t)
            finish = "length" if r.done >= r.max_tokens else None
            done = [self.token_id] * r.done if finish else []
            outs.append(
                RequestOutput(
                    rid,
                    len(r.prompt),
                    [CompletionOutput(0, [self.token_id], r.done, finish, token_ids=done)],
                    finish is not None,
                    queue_time=0.0 if r.done == 1 else None,
                )
            )
            if finish:
                del self._reqs[rid]
        return outs


def serve_gateway(port: int, tokenizer_dir: str, pace_s: float) -> None:
    import uvicorn
    from starlette.responses import Response
    from tokenizers import Tokenizer

    from wsllm.broker.memory import MemoryBroker
    from wsllm.config_gateway import GatewayConfig
    from wsllm.engine.worker import EngineWorker
    from wsllm.server.app import create_app, uvicorn_config

    (token_id,) = (
        Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
        .encode(TOKEN_TEXT, add_special_tokens=False)
        .ids
    )
    engine = FakeEngine(token_id, pace_s)
    broker = MemoryBroker(max_queue_depth=4096, max_event_batches=4096)
    worker = EngineWorker(engine, broker, idle_wait_s=0.005).start()
    # The anonymous tenant's default limits (128 in flight) would refuse the bench's own load.
    cfg = GatewayConfig(
        host="127.0.0.1", port=port, max_queue_depth=4096, frontend=False,
        anonymous_rpm=0, anonymous_tpm=0, anonymous_max_concurrent=0,
    )  # fmt: skip
    app = create_app(cfg, broker, tokenizer_dir, "fake")

    async def emits(request: Any) -> Response:
        body = orjson.dumps(engine.emits)
        engine.emits.clear()
        return Response(body, media_type="application/json")

    async def cpu(request: Any) -> Response:
        # The gateway's own CPU seconds so far: the process's, less the fake engine's
        # thread (the same work whatever the route), for a cost per token.
        assert worker.ident is not None
        engine_s = time.clock_gettime(time.pthread_getcpuclockid(worker.ident))
        return Response(orjson.dumps({"gateway_s": time.process_time() - engine_s}))

    app.add_route("/bench/emits", emits)
    app.add_route("/bench/cpu", cpu)
    uvicorn.Server(uvicorn_config(app, cfg, log_level="warning")).run()


# -- server side: the bare Starlette peer ------------------------------------------------------


def serve_bare(port: int, pace_s: float) -> None:
    """The same bytes on the same clock, with nothing in between: one ticker task
    feeds every open stream, as one engine step feeds every request."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    streams: dict[str, asyncio.Queue[float]] = {}
    emitted: dict[str, list[float]] = {}
    counter = iter(range(1 << 62))

    async def ticker() -> None:
        while True:
            await asyncio.sleep(pace_s)
            t = time.time()
            for rid, q in streams.items():
                emitted[rid].append(t)
                q.put_nowait(t)

    def open_stream() -> tuple[str, asyncio.Queue[float]]:
        rid = f"cmpl-{next(counter)}"
        streams[rid], emitted[rid] = asyncio.Queue(), []
        return rid, streams[rid]

    def chunk(rid: str, finish: str | None) -> bytes:
        return orjson.dumps(
            {
                "id": rid,
                "object": "text_completion",
                "created": 0,
                "model": "fake",
                "choices": [{"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish}],
            }
        )

    async def completions(request: Any) -> Response:
        n = orjson.loads(await request.body())["max_tokens"]
        rid, q = open_stream()

        async def frames() -> Any:
            try:
                for i in range(n):
                    await q.get()
                    yield b"id: %d\ndata: %s\n\n" % (i + 1, chunk(rid, "length" if i == n - 1 else None))
                yield b"data: [DONE]\n\n"
            finally:
                streams.pop(rid, None)

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text('{"type":"hello","model":"fake"}')
        msg = orjson.loads(await websocket.receive_text())
        rid, q = open_stream()
        try:
            for i in range(msg["max_tokens"]):
                await q.get()
                await websocket.send_text(
                    orjson.dumps(
                        {"type": "delta", "id": msg["id"], "seq": i, "index": 0, "text": TOKEN_TEXT}
                    ).decode()
                )
            await websocket.send_text(
                orjson.dumps(
                    {
                        "type": "done",
                        "id": msg["id"],
                        "index": 0,
                        "finish_reason": "length",
                        "request_id": rid,
                    }
                ).decode()
            )
        finally:
            streams.pop(rid, None)
        await websocket.close()

    async def emits(request: Any) -> Response:
        body = orjson.dumps(emitted)
        emitted.clear()
        return Response(body, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        task = asyncio.create_task(ticker())
        yield
        task.cancel()

    app = Starlette(
        routes=[
            Route("/health", lambda r: JSONResponse({"status": "ok"})),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/bench/emits", emits),
            WebSocketRoute("/v1/ws", ws),
        ],
        lifespan=lifespan,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", ws_per_message_deflate=False)


# -- client side -----------------------------------------------------------------------------------


@dataclass
class Stream:
    rid: str = ""
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, characters so far)


async def sse_client(port: int, n_tokens: int, out: Stream) -> None:
    body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": n_tokens, "stream": True, "ignore_eos": True})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    assert b" 200 " in await reader.readline()
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    buf, chars = b"", 0
    while True:  # chunked transfer encoding
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        data = (await reader.readexactly(size + 2))[:-2]
        now = time.time()
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: {"):
                    obj = orjson.loads(line[6:])
                    out.rid = obj["id"]
                    chars += sum(len(c["text"]) for c in obj["choices"])
                    out.arrivals.append((now, chars))
    writer.close()


async def ws_client(port: int, n_tokens: int, out: Stream) -> None:
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/ws", compression=None, max_size=None) as ws:
        await ws.recv()  # hello
        await ws.send(
            orjson.dumps(
                {
                    "type": "completion",
                    "id": "b",
                    "prompt": [1, 2, 3],
                    "max_tokens": n_tokens,
                    "ignore_eos": True,
                }
            ).decode()
        )
        chars = 0
        async for raw in ws:
            now = time.time()
            msg = orjson.loads(raw)
            if msg["type"] == "delta":
                chars += len(msg["text"])
                out.arrivals.append((now, chars))
            elif msg["type"] == "done":
                out.rid = msg["request_id"]
                return
            else:
                raise RuntimeError(msg)


@dataclass
class Result:
    tokens_per_s: float
    latencies_ms: list[float]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def run_load(port: int, transport: str, streams: int, n_tokens: int) -> Result:
    outs = [Stream() for _ in range(streams)]
    client = sse_client if transport == "sse" else ws_client
    t0 = time.time()
    await asyncio.gather(*(client(port, n_tokens, o) for o in outs))
    elapsed = time.time() - t0
    async with httpx.AsyncClient() as http:
        emits = (await http.get(f"http://127.0.0.1:{port}/bench/emits")).json()
    lat, total = [], 0
    for o in outs:
        emitted = emits[o.rid]
        # Token k has arrived once (k + 1) * len(TOKEN_TEXT) characters have.
        k = 0
        for t, chars in o.arrivals:
            while k < len(emitted) and (k + 1) * len(TOKEN_TEXT) <= chars:
                lat.append((t - emitted[k]) * 1000)
                k += 1
        total += chars_tokens(o)
    return Result(total / elapsed, lat)


def chars_tokens(o: Stream) -> int:
    return o.arrivals[-1][1] // len(TOKEN_TEXT) if o.arrivals else 0


# -- driver --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(kind: str, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        __file__,
        "--serve",
        kind,
        "--port",
        str(port),
        "--pace",
        str(args.pace),
        "--tokenizer",
        args.tokenizer,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {kind} server did not start")


def measure(args: argparse.Namespace) -> dict[tuple[str, int, str], Result]:
    """Both servers up at once; runs alternate between them (and repeat), so that
    both see the same background load."""
    results: dict[tuple[str, int, str], Result] = {}
    runs = [
        (t, n, kind)
        for _ in range(args.repeat)
        for t in ("sse", "ws")
        for n in args.streams
        for kind in ("bare", "gateway")
    ]
    ports = {kind: free_port() for kind in ("bare", "gateway")}
    procs = [start_server(kind, port, args) for kind, port in ports.items()]
    try:
        for port in ports.values():
            for transport in ("sse", "ws"):  # warm up both paths
                asyncio.run(run_load(port, transport, 8, 8))
        pooled: dict[tuple[str, int, str], list[Result]] = {}
        for transport, n, kind in tqdm(runs, desc="gateway overhead"):
            pooled.setdefault((transport, n, kind), []).append(
                asyncio.run(run_load(ports[kind], transport, n, args.tokens))
            )
        for key, rs in pooled.items():  # mean throughput, all latencies
            results[key] = Result(
                sum(r.tokens_per_s for r in rs) / len(rs), [x for r in rs for x in r.latencies_ms]
            )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    return results


def table(results: dict[tuple[str, int, str], Result], args: argparse.Namespace) -> str:
    demand = 1 / args.pace
    rows = [
        "| transport | streams | bare tok/s | gateway tok/s | gateway/bare | bare p50 / p99 ms | "
        "gateway p50 / p99 ms | added p50 / p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for transport in ("sse", "ws"):
        for n in args.streams:
            b, g = results[(transport, n, "bare")], results[(transport, n, "gateway")]
            bp = [percentile(b.latencies_ms, q) for q in (0.5, 0.99)]
            gp = [percentile(g.latencies_ms, q) for q in (0.5, 0.99)]
            rows.append(
                f"| {transport.upper()} | {n} | {b.tokens_per_s:,.0f} | {g.tokens_per_s:,.0f} | "
                f"{g.tokens_per_s / b.tokens_per_s:.2f} | {bp[0]:.1f} / {bp[1]:.1f} | {gp[0]:.1f} / {gp[1]:.1f} | "
                f"{gp[0] - bp[0]:+.1f} / {gp[1] - bp[1]:+.1f} |"
            )
    note = (
        f"Demand: {demand:.0f} tokens/s per stream ({args.tokens} tokens per stream, one token every "
        f"{args.pace * 1000:.0f} ms). Latency: from the engine step (or the bare ticker) that emitted a "
        "token to the client reading it; added = gateway minus bare. Each cell pools "
        f"{args.repeat} runs, alternating between the bare and the gateway server."
    )
    return "\n".join(rows) + "\n\n" + note


def write_docs(text: str, command: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    section = (
        "## Gateway overhead\n\n"
        f"`{command}` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}).\n\n{text}\n\n"
        "The client, both servers and the engine thread share the machine's cores, so where "
        "delivered tokens/s falls short of the demand everything is CPU-bound and the latencies "
        "include waiting for a core: compare the columns within a row, not across machines. The "
        "gateway's own cost per token is the broker hop from the worker thread, the router, "
        "incremental detokenization, stop-string matching, JSON and metrics.\n"
    )
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Gateway overhead\n.*?(?=^## |\Z)", re.S | re.M)
    new = (
        pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    )
    path.write_text(new.rstrip() + "\n")


def default_tokenizer_dir() -> str:
    from wsllm.models.loader import resolve_model_dir  # the bundled SmolLM2 (its tokenizer only)

    return str(resolve_model_dir(None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--pace", type=float, default=0.02, help="seconds between engine steps")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell, alternating bare and gateway")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2's)")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    p.add_argument("--serve", choices=["gateway", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve == "gateway":
        return serve_gateway(args.port, args.tokenizer, args.pace)
    if args.serve == "bare":
        return serve_bare(args.port, args.pace)
    args.tokenizer = args.tokenizer or default_tokenizer_dir()
    text = table(measure(args), args)
    print(text)
    if args.write_docs:
        flags = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        write_docs(text, f"python bench/gateway_overhead.py {flags}".strip())


if __name__ == "__main__":
    main()
