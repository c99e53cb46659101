"""What API keys, tenant quotas and model routing cost per request.

Two gateways, each in its own process, in the same run, behind the fake engine of
`gateway_overhead.py` (a decode step every `--pace` seconds): `plain` serves one
model with no keys; `tenants` has a keys file of 16 tenants (rpm, tpm and
max_concurrent set, high enough never to refuse), serves two models, and the clients
name the model by an alias. 64 SSE clients each send requests one after another (the first
round all at once); for each request it takes the time from the client sending it to
the gateway handing it to the broker (admission: parsing, the key, the tenant's limits,
the model's resolution, tokenization) and to its first token, and reports the p50/p99
of both and the difference between the gateways, for the burst and the rounds after.

    python bench/tenancy_overhead.py                 # print the table
    python bench/tenancy_overhead.py --write-docs    # and put it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from gateway_overhead import FakeEngine, default_tokenizer_dir, free_port, percentile
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
TENANTS = 16
ALIAS = "fake-alias"


def keys_file() -> str:
    path = Path(tempfile.mkdtemp()) / "keys.toml"
    path.write_text(
        "".join(
            f'[tenants.t{i}]\nkeys = ["sk-{i}"]\nrpm = 1000000\ntpm = 1000000000\nmax_concurrent = 1000\n'
            'models = ["*"]\n\n'
            for i in range(TENANTS)
        )
    )
    return str(path)


def serve(kind: str, port: int, tokenizer_dir: str, pace_s: float) -> None:
    import uvicorn
    from starlette.responses import Response
    from tokenizers import Tokenizer

    from wsllm.broker.memory import MemoryBroker
    from wsllm.config_gateway import GatewayConfig
    from wsllm.engine.worker import EngineWorker
    from wsllm.server.app import create_app, uvicorn_config

    (token_id,) = (
        Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").encode(" the", add_special_tokens=False).ids
    )
    broker = MemoryBroker(max_queue_depth=4096, max_event_batches=4096)
    submits: dict[str, float] = {}
    submit = broker.submit

    async def timed_submit(request: Any, **kw: Any) -> None:
        submits[request.request_id] = time.time()
        await submit(request, **kw)

    broker.submit = timed_submit  # type: ignore[method-assign]
    cfg = GatewayConfig(host="127.0.0.1", port=port, max_queue_depth=4096, frontend=False)
    if kind == "plain":
        EngineWorker(FakeEngine(token_id, pace_s), broker, idle_wait_s=0.005).start()
        app = create_app(cfg, broker, tokenizer_dir, "fake")
    else:
        cfg.api_keys_file = keys_file()
        # "fake" polls as the plain gateway's engine does; the idle "fake-b" as `wsllm serve`'s
        # engines do (the worker's default)
        for name, aliases, idle in (("fake", [ALIAS], {"idle_wait_s": 0.005}), ("fake-b", [], {})):
            engine = FakeEngine(token_id, pace_s, model_name=name)
            EngineWorker(engine, broker.engine_side(name), aliases=aliases, **idle).start()
        dirs = {"fake": Path(tokenizer_dir), "fake-b": Path(tokenizer_dir)}
        app = create_app(cfg, broker, tokenizer_dir, "fake", tokenizer_dirs=dirs)

    async def submitted(request: Any) -> Response:
        body = orjson.dumps(submits)
        submits.clear()
        return Response(body, media_type="application/json")

    app.add_route("/bench/submits", submitted)
    uvicorn.Server(uvicorn_config(app, cfg, log_level="warning")).run()


@dataclass
class Stream:
    rid: str = ""
    sent: float = 0.0
    first: float = 0.0
    chunks: int = 0


async def sse_client(port: int, n_tokens: int, key: str | None, model: str, out: Stream) -> None:
    body = orjson.dumps(
        {"model": model, "prompt": "Hello there", "max_tokens": n_tokens, "stream": True, "ignore_eos": True}
    )
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out.sent = time.time()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (auth, len(body), body)
    )
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    while True:  # chunked transfer encoding
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            break
        data = (await reader.readexactly(size + 2))[:-2]
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                if not out.first:
                    out.first = time.time()
                    out.rid = orjson.loads(line[6:])["id"]
                out.chunks += 1
    writer.close()


@dataclass
class Cell:
    admission_ms: list[float] = field(default_factory=list)  # rounds after the first
    burst_ms: list[float] = field(default_factory=list)  # the first round: all at once
    ttft_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)


async def run_load(port: int, kind: str, streams: int, n_tokens: int, cell: Cell, rounds: int = 1) -> None:
    """`streams` clients at once, each sending `rounds` requests one after the other
    (16 to 2 * n_tokens tokens each, so that they soon arrive at different times); the
    first round is a burst of `streams` requests at the same moment."""
    keyed = kind == "tenants"
    rng = random.Random(streams)
    outs: list[list[Stream]] = [[] for _ in range(streams)]

    async def client(i: int) -> None:
        for _ in range(rounds):
            o = Stream()
            outs[i].append(o)
            n = rng.randint(16, 2 * n_tokens) if rounds > 1 else n_tokens
            await sse_client(port, n, f"sk-{i % TENANTS}" if keyed else None, ALIAS if keyed else "fake", o)

    t0 = time.time()
    await asyncio.gather(*(client(i) for i in range(streams)))
    elapsed = time.time() - t0
    async with httpx.AsyncClient() as http:
        submits = (await http.get(f"http://127.0.0.1:{port}/bench/submits")).json()
    for per_client in outs:
        for r, o in enumerate(per_client):
            ms = (submits[o.rid] - o.sent) * 1000
            (cell.burst_ms if r == 0 else cell.admission_ms).append(ms)
            cell.ttft_ms.append((o.first - o.sent) * 1000)
    cell.tokens_per_s.append(sum(o.chunks for c in outs for o in c) / elapsed)


def start(kind: str, args: argparse.Namespace) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port), "--pace", str(args.pace),
           "--tokenizer", args.tokenizer]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            auth = {"authorization": "Bearer sk-0"} if kind == "tenants" else {}
            if httpx.get(f"http://127.0.0.1:{port}/ready", headers=auth, timeout=1).status_code == 200:
                return port, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the {kind} gateway did not start")


def measure(args: argparse.Namespace) -> dict[str, Cell]:
    """Both gateways up at once; runs alternate between them, so both see the same
    background load."""
    servers = {kind: start(kind, args) for kind in ("plain", "tenants")}
    cells = {kind: Cell() for kind in servers}
    try:
        for kind, (port, _) in servers.items():  # warm up
            asyncio.run(run_load(port, kind, 8, 4, Cell()))
        for _, kind in tqdm([(r, k) for r in range(args.repeat) for k in servers], desc="tenancy overhead"):
            asyncio.run(run_load(servers[kind][0], kind, args.streams, args.tokens, cells[kind], args.rounds))
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(10)
    return cells


def table(cells: dict[str, Cell], args: argparse.Namespace) -> str:
    rows = [
        "| gateway | admission p50 / p99 ms | burst of 64: admission p50 / p99 ms | first token p50 ms | tokens/s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    p50: dict[str, float] = {}
    b50: dict[str, float] = {}
    for kind, label in (("plain", "one model, no keys"), ("tenants", "16 tenants, 2 models, an alias")):
        c = cells[kind]
        a = [percentile(c.admission_ms, q) for q in (0.5, 0.99)]
        b = [percentile(c.burst_ms, q) for q in (0.5, 0.99)]
        p50[kind], b50[kind] = a[0], b[0]
        rows.append(
            f"| {label} | {a[0]:.2f} / {a[1]:.2f} | {b[0]:.2f} / {b[1]:.2f} | {percentile(c.ttft_ms, 0.5):.1f} | "
            f"{sum(c.tokens_per_s) / len(c.tokens_per_s):,.0f} |"
        )
    added, burst = p50["tenants"] - p50["plain"], b50["tenants"] - b50["plain"]
    return (
        "\n".join(rows)
        + f"\n\nKeys, quotas and routing add **{added:+.2f} ms** p50 per request with {args.streams} concurrent "
        f"streams ({burst:+.2f} ms when all {args.streams} arrive in the same instant). {args.repeat} runs of each "
        f"gateway, alternating; each of the {args.streams} clients sends {args.rounds} requests one after another "
        f"(the first all at once; then 16 to {2 * args.tokens} tokens each, so that arrivals spread); an engine step "
        f"every {args.pace * 1000:.0f} ms. Admission: from the client sending the request to the gateway handing it "
        "to the broker."
    )


def write_docs(text: str, command: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    section = (
        "## Tenancy and routing overhead\n\n"
        f"`{command}` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}).\n\n{text}\n\n"
        "The quota checks here are the in-process limiter (`wsllm serve`); with Redis each admission "
        "adds one Lua call (a round trip to Redis) and each release another.\n"
    )
    old = path.read_text()
    pattern = re.compile(r"^## Tenancy and routing overhead\n.*?(?=^## |\Z)", re.S | re.M)
    new = (
        pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    )
    path.write_text(new.rstrip() + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    p.add_argument("--pace", type=float, default=0.02, help="seconds between engine steps")
    p.add_argument("--repeat", type=int, default=3, help="runs of each gateway, alternating")
    p.add_argument("--rounds", type=int, default=4, help="requests per client in a run, one after another")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2's)")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    p.add_argument("--serve", choices=["plain", "tenants"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.serve, args.port, args.tokenizer, args.pace)
    args.tokenizer = args.tokenizer or default_tokenizer_dir()
    text = table(measure(args), args)
    print(text)
    if args.write_docs:
        flags = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        write_docs(text, f"python bench/tenancy_overhead.py {flags}".strip())


if __name__ == "__main__":
    main()
