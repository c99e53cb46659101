"""The figures of bench/broker_scale.py: one configuration's row from what its load
clients and redis-servers recorded, the table, and --write-docs."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    label: str
    tokens_s: float
    redis_cores: list[float]  # per server
    throttled: list[float]  # share of quota periods throttled, per server
    cmds_per_token: float
    cmds_s: float
    ttft_added: tuple[float, float]  # p50, p99 in ms: first token less one step
    tpot_added: tuple[float, float]  # p50, p99 in ms of the gaps between a stream's deltas
    requests: int
    errors: int
    bytes_per_stream: float
    by_command: dict[str, float] = field(default_factory=dict)  # commands per token, by command
    cpu_us: dict[str, float] = field(default_factory=dict)  # CPU µs per token by role: gateway, engines, load


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(label: str, args: argparse.Namespace, results: list[Any], tokens: int, s0: list[Any],
         s1: list[Any], t0: float, t1: float, bytes_per_stream: float, lat: dict[str, list[Any]]) -> Row:  # fmt: skip
    """`tokens`: received in [t0, t1); latencies: first tokens and gaps between deltas
    received in it, less one step each."""
    window = [r for r in results if t0 <= r[2] <= t1]
    ok = [r for r in window if r[4] is None and r[3] > 0]
    secs = t1 - t0
    step = args.step_ms / 1000
    ttft = [(v - step) * 1000 for t, v in lat["ttfts"] if t0 <= t < t1]
    tpot = [v * 1000 for t, v in lat["gaps"] if t0 <= t < t1]
    calls = sum(b["calls"] - a["calls"] for a, b in zip(s0, s1, strict=True))
    cores = [(b["cpu_s"] - a["cpu_s"]) / secs for a, b in zip(s0, s1, strict=True)]
    thr = [
        (b["throttled"] - a["throttled"]) / max(1, b["periods"] - a["periods"])
        for a, b in zip(s0, s1, strict=True)
    ]
    by: dict[str, float] = {}
    for a, b in zip(s0, s1, strict=True):
        for cmd, n in b["by"].items():
            by[cmd] = by.get(cmd, 0.0) + (n - a["by"].get(cmd, 0)) / max(1, tokens)
    top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:6])
    return Row(
        label, tokens / secs, cores, thr, calls / max(1, tokens), calls / secs,
        (_pct(ttft, 0.5), _pct(ttft, 0.99)), (_pct(tpot, 0.5), _pct(tpot, 0.99)),
        len(window), len(window) - len(ok), bytes_per_stream, top,
    )  # fmt: skip


def table(rows: list[Row], args: argparse.Namespace) -> str:
    head = (
        "| configuration | tokens/s | Redis CPU per server (cores) | throttled | commands/token | commands/s "
        "| TTFT added p50 / p99 (ms) | delta gap p50 / p99 (ms) | requests (errors) | Redis bytes/stream |\n"
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    body = ""
    for r in rows:
        cpu = " ".join(f"{c:.3f}" for c in r.redis_cores) or "-"
        thr = " ".join(f"{t:.2f}" for t in r.throttled) or "-"
        body += (
            f"| {r.label} | {r.tokens_s:,.0f} | {cpu} | {thr} | {r.cmds_per_token:.2f} | {r.cmds_s:,.0f} "
            f"| {r.ttft_added[0]:.0f} / {r.ttft_added[1]:.0f} | {r.tpot_added[0]:.1f} / {r.tpot_added[1]:.1f} "
            f"| {r.requests} ({r.errors}) | {r.bytes_per_stream:,.0f} |\n"
        )
    body += (
        "\nCommands per token, the largest: "
        + "; ".join(f"{r.label}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.by_command.items()) for r in rows)
        + ".\n"
    )
    body += (
        "\nCPU per token (µs), by process role: "
        + "; ".join(
            f"{r.label}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.cpu_us.items())) for r in rows
        )
        + ".\n"
    )
    tail = (
        f"\n{args.engines} fake engines ({args.engine_procs} processes, steps of {args.step_ms:g} ms, "
        f"{args.max_num_seqs} sequences each), {args.gateways} gateways, {args.clients} load clients, "
        f"{args.streams} WebSocket streams ({args.per_socket} a socket) of {args.max_tokens} tokens over "
        f"{args.models} model names; every redis-server capped at {args.redis_cpu or 'no'} cores; "
        f"{args.warmup_s:g} s warm-up, {args.duration_s:g} s measured.\n"
    )
    if len(rows) == 2 and rows[0].tokens_s > 0:
        tail += f"\nCluster / one instance, tokens/s: **{rows[1].tokens_s / rows[0].tokens_s:.2f}x**.\n"
    return head + body + tail


def write_docs(text: str) -> None:
    """The table into docs/benchmarks.md ("Broker at scale") and docs/scaling.md (between
    its markers), with the command, the date and the CPU's flags."""
    with open("/proc/cpuinfo") as f:
        flags = next((ln.strip() for ln in f if ln.startswith("flags")), "flags: ?")
    command = "python " + " ".join(["bench/broker_scale.py", *sys.argv[1:]])
    block = f"```\n{command}\n```\n\n{text}\nMachine: {os.cpu_count()} cores, {datetime.date.today()}; `{flags}`.\n"
    bench = ROOT / "docs" / "benchmarks.md"
    doc = bench.read_text()
    section = f"## Broker at scale\n\n{block}"
    m = re.search(r"## Broker at scale\n.*?(?=\n## |\Z)", doc, re.S)
    doc = doc.replace(m.group(0), section.rstrip("\n")) if m else doc.rstrip("\n") + "\n\n" + section
    bench.write_text(doc.rstrip("\n") + "\n")
    scaling = ROOT / "docs" / "scaling.md"
    if scaling.exists():
        s = scaling.read_text()
        begin, end = "<!-- broker_scale:begin -->", "<!-- broker_scale:end -->"
        if begin in s and end in s:
            s = s[: s.index(begin) + len(begin)] + "\n" + block + s[s.index(end) :]
            scaling.write_text(s)
