"""Speculative decoding: wsllm with and without it, and llama-server with its n-gram drafting, on the
same machine, one server at a time.

Two workloads, each at concurrency 1 and 32, driven by `wsllm bench` over SSE on
`/v1/chat/completions`, greedy (or at `--temperature`, which writes a section of its own):
- *quoting*: a prompt that holds a few hundred tokens of this repository's own code or docs and asks
  for it back with a small change (up to `--quote-len` tokens, stopping where the model stops);
- *free*: plain one-turn chat questions (bench/serving_peers.py's), `--free-len` tokens, `ignore_eos`.
Output tokens/s is the servers' `usage.completion_tokens` over each run's duration. wsllm runs with
`--speculative off` and `--speculative ngram` alternately, `--repeat` times each, and each cell keeps
its best run (a shared 2-core machine moves 30% between minutes; the best of a few is the steadiest
figure). llama-server (the same Q4_1 GGUF) runs quoting at c=1 with each `--spec-type` it has; the best
n-gram type then runs every cell. The speculative wsllm's drafted and accepted tokens come from its
/metrics (`wsllm bench` reads them around each run). The table goes into the "Speculative decoding" section of docs/benchmarks.md.

    python bench/speculative.py                       # everything (about 20 minutes)
    python bench/speculative.py --no-llamacpp --repeat 1 --no-write-docs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_peers as sp  # noqa: E402  (sibling scripts, not a package)
import serving_report  # noqa: E402

ROOT = sp.ROOT
TITLE = "Speculative decoding"
LLAMA_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
CELLS = (("quoting", 1), ("quoting", 32), ("free", 1), ("free", 32))
_ASKS = (
    "Return this code exactly as it is, except rename `{a}` to `{b}`. Reply with the code only.",
    "Here is some code. Give it back unchanged except that `{a}` becomes `{b}`.",
    "Copy the following text exactly, but write `{b}` wherever it says `{a}`.",
)


def quote_sources() -> list[str]:
    """Passages of 600-1,400 characters: the functions of the engine's modules, the paragraphs of docs/."""
    out: list[str] = []
    for path in sorted((ROOT / "wsllm" / "engine").glob("*.py")):
        for block in re.split(r"\n(?=    def |def |class )", path.read_text()):
            if 600 <= len(block) <= 1400:
                out.append(block.strip("\n") + "\n")
    for path in sorted((ROOT / "docs").glob("*.md")):
        for para in path.read_text().split("\n\n"):
            if 600 <= len(para) <= 1400 and not para.startswith(("|", "```", "#")):
                out.append(para.strip() + "\n")
    return out


def quoting_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    sources = quote_sources()
    rng.shuffle(sources)
    chats = []
    for i in range(n):
        text = sources[i % len(sources)]
        words = sorted({w for w in re.findall(r"[A-Za-z_]{5,}", text)}) or ["the"]
        a = rng.choice(words)
        ask = rng.choice(_ASKS).format(a=a, b=a.upper())
        chats.append([{"role": "user", "content": f"{ask}\n\n```\n{text}```"}])
    return chats


def write_prompts(path: Path, chats: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


def bench(
    port: int, prompts: Path, level: int, n: int, length: int, eos: bool, out: Path, temperature: float = 0.0
) -> dict[str, Any]:
    cmd = [str(Path(sys.executable).parent / "wsllm"), "bench", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "chat", "--prompts", str(prompts), "--num-requests", str(n), "--concurrency",
           str(level), "--output-len", str(length), "--temperature", f"{temperature:g}", "--json", str(out)]  # fmt: skip
    if not eos:
        cmd.append("--ignore-eos")
    r = subprocess.run(cmd, capture_output=True, text=True, env=sp._bench_env())
    if r.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"wsllm bench failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dict(json.loads(out.read_text())["runs"][0])


def run_server(name: str, extra: list[str], args: argparse.Namespace, work: Path, cells: tuple) -> dict:
    """Start one server configuration, run `cells`, stop it: {cell: (tokens/s, counters)}."""
    port = sp.free_port()
    ns = argparse.Namespace(**vars(args))
    ns.wsllm_args = shlex.join(extra) if name == "wsllm" else ""
    server = sp.make_server(name, port, ns)
    if name == "llamacpp":
        server.argv += extra
    tag = "-".join([name, *[e.strip("-") for e in extra]])
    results: dict[tuple[str, int], tuple[float, dict[str, float]]] = {}
    with sp.running(server, port, work / f"{tag}.log"):
        for kind, level in cells:
            n = args.requests_c1 if level == 1 else args.requests_c32
            prompts = work / f"{kind}-{level}.jsonl"
            length = args.quote_len if kind == "quoting" else args.free_len
            out = work / f"{tag}-{kind}-{level}.json"
            run = bench(port, prompts, level, n, length, kind == "quoting", out, args.temperature)
            counters = run.get("speculation") or {}  # wsllm bench read the server's /metrics
            tps = serving_report.tokens_per_s(run)
            print(f"  {tag} {kind} c={level}: {tps:.1f} tokens/s {counters or ''}", file=sys.stderr)
            results[(kind, level)] = (tps, counters)
    return results


def best(runs: list[dict]) -> dict:
    out: dict = {}
    for r in runs:
        for cell, value in r.items():
            if cell not in out or value[0] > out[cell][0]:
                out[cell] = value
    return out


def measure(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    for kind, level in CELLS:
        n = args.requests_c1 if level == 1 else args.requests_c32
        seed = args.seed + level
        chats = quoting_prompts(n, seed) if kind == "quoting" else sp.chat_prompts(n, seed)
        write_prompts(work / f"{kind}-{level}.jsonl", chats)
    rows: dict[str, dict] = {}
    off, on = [], []
    for i in range(args.repeat):  # alternating, so that a slow minute falls on both
        order = [("off", off), ("ngram", on)] if i % 2 == 0 else [("ngram", on), ("off", off)]
        for mode, runs in order:
            runs.append(run_server("wsllm", ["--speculative", mode], args, work, CELLS))
    rows["wsllm, no speculation"], rows["wsllm --speculative ngram"] = best(off), best(on)
    if args.llamacpp:
        tries = {t: run_server("llamacpp", ["--spec-type", t], args, work, CELLS[:1]) for t in LLAMA_TYPES}
        ngram = {t: r for t, r in tries.items() if t != "none"}
        top = max(ngram, key=lambda t: ngram[t][CELLS[0]][0])
        rows["llama-server, no speculation"] = tries["none"]
        for t, r in ngram.items():
            if t != top:
                rows[f"llama-server --spec-type {t}"] = r
        rows[f"llama-server --spec-type {top} (its best)"] = run_server(
            "llamacpp", ["--spec-type", top], args, work, CELLS
        )
    return rows


def section_title(temperature: float) -> str:
    """Greedy runs keep the section they always had; a sampled run gets one of its own."""
    return TITLE if temperature == 0 else f"{TITLE} at temperature {temperature:g}"


def report(rows: dict[str, dict], args: argparse.Namespace, command: str) -> str:
    head = "| server | " + " | ".join(f"{k} c={c}" for k, c in CELLS) + " |"
    lines = [head, "| --- |" + " ---: |" * len(CELLS)]
    for name, cells in rows.items():
        lines.append(
            f"| {name} | " + " | ".join(f"{cells[c][0]:.1f}" if c in cells else "–" for c in CELLS) + " |"
        )
    on, off = rows["wsllm --speculative ngram"], rows["wsllm, no speculation"]
    ratio = [f"{on[c][0] / off[c][0]:.2f}x" if off[c][0] else "–" for c in CELLS]
    lines.append("| **ngram / none (wsllm)** | " + " | ".join(ratio) + " |")
    llama = [(n, r) for n, r in rows.items() if n.startswith("llama-server --spec-type") and CELLS[0] in r]
    if llama:
        name, r = max(llama, key=lambda nr: nr[1][CELLS[0]][0])
        lines.append(
            f"| **wsllm ngram / {name}**, quoting c=1 | {on[CELLS[0]][0] / r[CELLS[0]][0]:.2f}x | | | |"
        )
    accept = []
    for c in CELLS:
        k = on.get(c, (0.0, {}))[1]
        if k.get("drafted"):
            accept.append(f"{c[0]} c={c[1]}: {k['drafted']} drafted, {k['accepted']} accepted, "
                          f"{k['mean_accepted_length']:.2f} tokens a verification")  # fmt: skip
        elif c in on:
            accept.append(f"{c[0]} c={c[1]}: none drafted")
    return "\n".join(
        [
            f"## {section_title(args.temperature)}\n",
            ("Greedy. " if args.temperature == 0 else f"Every request at temperature {args.temperature:g}. ")
            + "`bench/speculative.py` (its docstring says how): output tokens/s, each server alone, the best of "
            f"{args.repeat} alternating runs for wsllm; quoting prompts hold a passage of this repository "
            f"(code or docs) and ask it back with one rename (up to {args.quote_len} tokens, to the model's "
            f"own end); free prompts are one-turn chat questions ({args.free_len} tokens, `ignore_eos`); "
            f"{args.requests_c1} requests at c=1, {args.requests_c32} at c=32.\n",
            f"```\n{command}\n```\n",
            f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({serving_report.cpu_model()}).\n",
            "\n".join(lines) + "\n",
            ("What the speculative wsllm verified (its /metrics): " + "; ".join(accept) + ".\n")
            if accept
            else "",
            f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="wsllm runs per mode, alternating; the best counts")
    p.add_argument("--requests-c1", type=int, default=8)
    p.add_argument("--requests-c32", type=int, default=64)
    p.add_argument("--quote-len", type=int, default=320, help="most output tokens of a quoting request")
    p.add_argument("--free-len", type=int, default=128, help="output tokens of a free request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sent with every request (0: greedy); its own docs section",
    )
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="wsllm only")
    p.add_argument("--peers-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=None, help="keep logs and bench JSON here")
    p.add_argument("--ready-timeout-s", type=float, default=None)
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    args = p.parse_args(argv)
    # what serving_peers' make_server reads: llama-server's slots and context for 32 streams
    args.levels, args.output_len = [32], max(args.quote_len, args.free_len) + 512
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/speculative.py", *(sys.argv[1:] if argv is None else argv)])
    with contextlib.ExitStack() as stack:
        work = args.out_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="speculative-")))
        work.mkdir(parents=True, exist_ok=True)
        rows = measure(args, work)
    text = report(rows, args, command)
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        title = section_title(args.temperature)
        path.write_text(serving_report.replace_section(path.read_text(), title, text))
        print(f"wrote the '{title}' section of {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
