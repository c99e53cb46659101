"""The table that bench/serving_peers.py writes, and its section of docs/benchmarks.md.

Pure text work on `wsllm bench` JSON (one run dict per concurrency level), so it is tested
without any server."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any

TITLE = "Serving against peers (CPU)"
PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama-server"}


@dataclass(slots=True)
class Row:
    """One server's figures in one run."""

    name: str  # wsllm | vllm | llamacpp
    label: str  # as the table names it
    ready_s: float  # from starting the process to its readiness endpoint answering 200
    runs: dict[
        str, dict[int, dict[str, Any]]
    ]  # sampling setting -> concurrency level -> its `wsllm bench` run
    load_before: float  # 1-minute load average when the server was started
    load_after: float  # and when it was stopped
    rss_mb: tuple[float, float] | None = None  # the process tree's resident MB: loaded, after one request
    kv_tokens: int | None = None  # KV capacity it was given, where the run set one


def tokens_per_s(run: dict[str, Any]) -> float:
    return float(run["output_throughput"])


def ttft_p50_s(run: dict[str, Any]) -> float | None:
    p50 = run["ttft_ms"]["p50"]
    return None if p50 is None else p50 / 1000


def _spread(values: list[int]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def output_tokens(runs: dict[int, dict[str, Any]]) -> str:
    """Each completed request's output tokens over all levels (all equal `--output-len` when the
    server honoured ignore_eos), and whether the server reported usage."""
    reqs = [q for run in runs.values() for q in run["requests"] if q["ok"]]
    usage = all(run["usage_reported"] for run in runs.values())
    return _spread([q["output_tokens"] for q in reqs]) + ("" if usage else " (chunks; no usage)")


def prompt_tokens(runs: dict[int, dict[str, Any]]) -> str:
    return _spread([q["prompt_tokens"] for run in runs.values() for q in run["requests"] if q["ok"]])


def _cell(run: dict[str, Any]) -> str:
    failed = f" ({run['failed']} failed)" if run["failed"] else ""
    return f"{tokens_per_s(run):.1f}{failed}"


def table(rows: list[Row], levels: list[int]) -> str:
    first = levels[0]
    head = ["server", "sampling", *(f"c={c}" for c in levels), f"TTFT p50 at c={first} (s)", "prompt tokens",
            "output tokens", "ready in (s)", "resident MB (loaded / 1 request)", "KV tokens"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for r in rows:
        for setting, runs in r.runs.items():
            ttft = ttft_p50_s(runs[first])
            cells = [r.label, setting, *(_cell(runs[c]) for c in levels), "–" if ttft is None else f"{ttft:.3f}",
                     prompt_tokens(runs), output_tokens(runs), f"{r.ready_s:.1f}",
                     f"{r.rss_mb[0]:.0f} / {r.rss_mb[1]:.0f}" if r.rss_mb else "–",
                     f"{r.kv_tokens}" if r.kv_tokens else "–"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    theirs = tokens_per_s(b)
    return f"{tokens_per_s(a) / theirs:.2f}x" if theirs else "–"


def ratios(rows: list[Row], levels: list[int]) -> str:
    """wsllm over each peer, setting by setting: tokens/s (higher is better for wsllm) and TTFT (lower
    is better)."""
    by = {r.name: r for r in rows}
    if "wsllm" not in by or not set(by) & set(PEER_NAMES):
        return ""
    first, ws = levels[0], by["wsllm"]
    head = ["ratio", "sampling", *(f"tokens/s c={c}" for c in levels), f"TTFT p50 c={first}"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for name, peer_name in PEER_NAMES.items():
        if name not in by:
            continue
        for setting, mine in ws.runs.items():
            theirs = by[name].runs.get(setting)
            if theirs is None:
                continue
            cells = [f"wsllm / {peer_name}", setting, *(_ratio(mine[c], theirs[c]) for c in levels)]
            a, b = ttft_p50_s(mine[first]), ttft_p50_s(theirs[first])
            cells.append(f"{a / b:.2f}x" if a is not None and b else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against_greedy(rows: list[Row], levels: list[int]) -> str:
    """Each server's sampled settings over its own greedy run: what sampling costs it."""
    head = ["server", "sampling / greedy", *(f"c={c}" for c in levels)]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * len(levels)]
    for r in rows:
        greedy = r.runs.get("greedy")
        for setting, runs in r.runs.items():
            if greedy is not None and setting != "greedy":
                lines.append(
                    "| "
                    + " | ".join([r.label, setting, *(_ratio(runs[c], greedy[c]) for c in levels)])
                    + " |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


def cpu_flags() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return line.strip()
    return "flags: (no /proc/cpuinfo)"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


#: the sampling settings measured side by side: greedy, a chat UI's usual ones, Qwen's recommended ones
SAMPLINGS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "t0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
    "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
}


def settings_text(args: argparse.Namespace) -> str:
    """The run's settings as the docs name them: `greedy` (temperature 0), `t0.7-p0.9` (...), ..."""
    out = []
    for name in args.samplings:
        fields = ", ".join(f"{k} {v:g}" for k, v in SAMPLINGS[name].items())
        out.append(f"`{name}` ({fields})")
    return "; ".join(out)


def section(rows: list[Row], args: argparse.Namespace, command: str, date: str) -> str:
    """The whole docs section, from its `## ` title to its last line."""
    smoke = (
        f"**Smoke run** ({args.num_requests} requests per level, on a machine shared with other work): it shows "
        "that each server starts, answers and stops. Its figures are not a measurement; the real one runs "
        "on a quiet machine with the default number of requests.\n\n"
        if args.smoke
        else ""
    )
    loads = ", ".join(f"{r.name} {r.load_before:.1f} → {r.load_after:.1f}" for r in rows)
    parts = [
        f"## {TITLE}\n",
        smoke
        + "`bench/serving_peers.py` starts each server alone (never two at once), waits until it is ready, "
        "drives it with `wsllm bench` over SSE on `/v1/chat/completions` and stops it. Every server gets the "
        f"same one-turn chat prompts (seed {args.seed}; a fresh set of {args.num_requests} per concurrency "
        f"level and sampling setting), {args.output_len} output tokens each, `ignore_eos`, under each "
        f"sampling setting ({settings_text(args)}; each server gets the same fields and applies its own "
        "defaults to the rest, llama-server's top-k 40 and min-p 0.05 among them). Output tokens/s is the "
        "servers' `usage.completion_tokens` over each level's duration. The peers are built by "
        "`bench/peers_setup.py` (see its docstring); wsllm serves the Q4_1 GGUF in its blocks (its default), "
        "llama-server the same GGUF, vLLM the HF directory that wsllm's loader writes (the same weights "
        "de-quantized) at its best dtype here. Resident memory is the RSS of the server's process tree "
        "once ready and after one request; wsllm gets llama-server's KV capacity (its `-c`).\n",
        f"```\n{command}\n```\n",
        f"{date}, {os.cpu_count()} cores ({cpu_model()}). 1-minute load average at each server's start → "
        f"stop: {loads}.\n",
        "Output tokens/s per concurrency level; prompt and output tokens per request as each server counted "
        "them (its chat template decides the prompt's length):\n",
        table(rows, args.levels) + "\n",
    ]
    if args.smoke:
        parts.append("No ratios from a smoke run: on a shared machine they say more about the other work.\n")
    elif rat := ratios(rows, args.levels):
        parts.append(
            "wsllm over each peer (tokens/s: above 1 is wsllm faster; TTFT: below 1 is wsllm sooner):\n"
        )
        parts.append(rat + "\n")
    if not args.smoke and (cost := against_greedy(rows, args.levels)):
        parts.append(
            "Each server's sampled settings over its own greedy tokens/s (1.00x: sampling costs nothing):\n"
        )
        parts.append(cost + "\n")
    parts.append(f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{cpu_flags()}\n```")
    return "\n".join(parts)


def replace_section(doc: str, title: str, text: str) -> str:
    """`doc` with its `## {title}` section (up to the next `## ` heading) replaced by `text`, or
    with `text` appended when there is none; everything else stays as it was."""
    own = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    body = text.rstrip("\n") + "\n"
    if own.search(doc):
        return own.sub(lambda m: body + ("\n" if m.end() < len(doc) else ""), doc, count=1)
    return doc.rstrip("\n") + "\n\n" + body
