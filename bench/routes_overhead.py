"""What each API costs per streamed token next to chat completions: completions
(`/v1/completions`), OpenAI's Responses (`/v1/responses`) and Anthropic's Messages
(`/v1/messages`), every route that streams tokens, each through its wing of the gateway.

One gateway process behind the fake engine of `gateway_overhead.py` (one token per
running request every `--pace` seconds, through the real worker loop, memory broker
and gateway). In the same run, alternating, N concurrent SSE clients stream from each
route (the same prompt, the same number of tokens). For 64 and 256 streams it reports
per route delivered tokens/s, the latency from a token's emission by the engine to its
arrival at the client (p50/p99), and the gateway's CPU time per delivered token (the
process's, less the fake engine's thread), each route as a ratio to chat (the bar:
within 10% per token).

    python bench/routes_overhead.py                 # print the table
    python bench/routes_overhead.py --write-docs    # and put it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from gateway_overhead import (
    TOKEN_TEXT,
    Result,
    Stream,
    chars_tokens,
    default_tokenizer_dir,
    free_port,
    percentile,
    start_server,
)
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
ROUTES = ("chat", "completions", "responses", "messages")
_MESSAGES = [{"role": "user", "content": "Hello"}]


def _request(route: str, n_tokens: int) -> tuple[bytes, bytes]:
    if route == "chat":
        body: dict[str, Any] = {"messages": _MESSAGES, "max_tokens": n_tokens, "stream": True}
        return b"/v1/chat/completions", orjson.dumps(body)
    if route == "completions":
        body = {"prompt": "Hello", "max_tokens": n_tokens, "stream": True}
        return b"/v1/completions", orjson.dumps(body)
    if route == "responses":
        body = {"input": "Hello", "max_output_tokens": n_tokens, "stream": True}
        return b"/v1/responses", orjson.dumps(body)
    body = {"model": "fake", "messages": _MESSAGES, "max_tokens": n_tokens, "stream": True}
    return b"/v1/messages", orjson.dumps(body)


def _chars(route: str, obj: dict[str, Any], out: Stream) -> int:
    """Characters of answer text in one event; sets the engine request id."""
    if route == "chat":
        out.rid = str(obj["id"])
        return sum(len(c["delta"].get("content") or "") for c in obj["choices"])
    if route == "completions":
        out.rid = str(obj["id"])
        return sum(len(c["text"]) for c in obj["choices"])
    kind = obj["type"]
    if route == "responses":
        if kind == "response.created":
            out.rid = "resp-" + obj["response"]["id"].removeprefix("resp_")  # the engine's id of it
        return len(str(obj["delta"])) if kind == "response.output_text.delta" else 0
    if kind == "message_start":
        out.rid = str(obj["message"]["id"])  # the engine's id
    if kind == "content_block_delta" and obj["delta"]["type"] == "text_delta":
        return len(obj["delta"]["text"])
    return 0


async def sse_client(port: int, route: str, n_tokens: int, out: Stream) -> None:
    path, body = _request(route, n_tokens)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (path, len(body), body)
    )
    await writer.drain()
    status = await reader.readline()
    assert b" 200 " in status, status
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
                    got = _chars(route, orjson.loads(line[6:]), out)
                    if got:
                        chars += got
                        out.arrivals.append((now, chars))
    writer.close()


async def _gateway_cpu_s(http: httpx.AsyncClient, port: int) -> float:
    return float((await http.get(f"http://127.0.0.1:{port}/bench/cpu")).json()["gateway_s"])


async def run_load(port: int, route: str, streams: int, n_tokens: int) -> tuple[Result, float]:
    """One run of `streams` clients on `route`: its Result and the gateway's CPU
    microseconds per delivered token."""
    outs = [Stream() for _ in range(streams)]
    async with httpx.AsyncClient() as http:
        cpu0 = await _gateway_cpu_s(http, port)
        t0 = time.time()
        await asyncio.gather(*(sse_client(port, route, n_tokens, o) for o in outs))
        elapsed = time.time() - t0
        cpu = await _gateway_cpu_s(http, port) - cpu0
        emits = (await http.get(f"http://127.0.0.1:{port}/bench/emits")).json()
    lat, total = [], 0
    for o in outs:
        emitted, k = emits[o.rid], 0
        for t, chars in o.arrivals:  # token k has arrived once (k + 1) tokens' characters have
            while k < len(emitted) and (k + 1) * len(TOKEN_TEXT) <= chars:
                lat.append((t - emitted[k]) * 1000)
                k += 1
        total += chars_tokens(o)
    return Result(total / elapsed, lat), cpu * 1e6 / max(total, 1)


Cell = tuple[Result, float]  # pooled runs of one route at one concurrency, and CPU us/token


def measure(args: argparse.Namespace) -> dict[tuple[str, int], Cell]:
    """One gateway; runs alternate between the routes (and repeat), so that all see
    the same background load."""
    port = free_port()
    proc = start_server("gateway", port, args)
    pooled: dict[tuple[str, int], list[tuple[Result, float]]] = {}
    try:
        for route in args.routes:  # warm up every path
            asyncio.run(run_load(port, route, 8, 8))
        runs = [(n, route) for _ in range(args.repeat) for n in args.streams for route in args.routes]
        for n, route in tqdm(runs, desc="routes overhead"):
            pooled.setdefault((route, n), []).append(asyncio.run(run_load(port, route, n, args.tokens)))
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        key: (
            Result(sum(r.tokens_per_s for r, _ in rs) / len(rs), [x for r, _ in rs for x in r.latencies_ms]),
            sum(c for _, c in rs) / len(rs),
        )
        for key, rs in pooled.items()
    }


def table(results: dict[tuple[str, int], Cell], args: argparse.Namespace) -> str:
    rows = [
        "| streams | route | tok/s | p50 / p99 ms | added p50 / p99 ms | gateway CPU µs/token | cost / chat |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in args.streams:
        chat, chat_cpu = results[("chat", n)]
        cp = [percentile(chat.latencies_ms, q) for q in (0.5, 0.99)]
        for route in args.routes:
            r, cpu = results[(route, n)]
            rp = [percentile(r.latencies_ms, q) for q in (0.5, 0.99)]
            added = "" if route == "chat" else f"{rp[0] - cp[0]:+.1f} / {rp[1] - cp[1]:+.1f}"
            rows.append(
                f"| {n} | {route} | {r.tokens_per_s:,.0f} | {rp[0]:.1f} / {rp[1]:.1f} | {added} | "
                f"{cpu:.0f} | {cpu / chat_cpu:.2f} |"
            )
    note = (
        f"Demand: {1 / args.pace:.0f} tokens/s per stream ({args.tokens} tokens per stream, one token every "
        f"{args.pace * 1000:.0f} ms), SSE on every route. Latency: from the engine step that emitted a token "
        "to the client reading it; added = the route's minus chat's. Gateway CPU: the gateway process's CPU "
        "time less the fake engine thread's, over the tokens delivered (a request's parsing, template and "
        "answer included); cost / chat is the acceptance figure (within 1.10). Each cell pools "
        f"{args.repeat} runs, alternating between the routes on one gateway."
    )
    return "\n".join(rows) + "\n\n" + note


def write_docs(text: str, command: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    section = (
        "## Overhead of each API's routes\n\n"
        f"`{command}` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}):\n\n{text}\n"
    )
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    # the section of an earlier run, under this name or its former one
    pattern = re.compile(
        r"^## Overhead of (?:each API's routes|the Responses and Messages routes)\n.*?(?=^## |\Z)",
        re.S | re.M,
    )
    new = (
        pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    )
    path.write_text(new.rstrip() + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--pace", type=float, default=0.02, help="seconds between engine steps")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell, alternating the routes")
    p.add_argument(
        "--routes", nargs="+", choices=ROUTES, default=list(ROUTES), help="chat is always measured"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2's)")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    args = p.parse_args()
    args.routes = ["chat", *(r for r in args.routes if r != "chat")]
    args.tokenizer = args.tokenizer or default_tokenizer_dir()
    text = table(measure(args), args)
    print(text)
    if args.write_docs:
        flags = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        write_docs(text, f"python bench/routes_overhead.py {flags}".strip())


if __name__ == "__main__":
    main()
