"""The other families on the CPU: wsllm serve against llama-server on the same random-weight GGUF of
Gemma-3-4B's shape and of gpt-oss-20b's layer shapes (issue 47's bench).

The files (bench/family_shapes.py): Gemma-3-4B whole (34 layers, 1024-token windows on 5 of every
6, its rotary bases, GeGLU, sandwich norms; Q4_0, the norms F32) and a given number of gpt-oss-20b's
24 layers (`--layers`; its experts in MXFP4, sinks, biases, 128-token windows on every other layer,
YaRN), each with the bundled SmolLM2 tokenizer padded to the shape's vocabulary, written once
(streamed). The default of 16 layers is a 7.7 GB file: about 8 GB resident, one server at a time,
on a 23 GB machine.

Each server is started alone, measured and stopped (bench/random_gguf.py, as bench/moe.py does):
`wsllm bench` chat prompts, `ignore_eos`, 64 tokens, at c = 1, 8 and 32, greedy and at temperature
0.7 with top_p 0.9 (`--sampling`), and the peak resident memory of its process tree.

Then the Gemma-3 shape at 16k tokens of context (`--no-long` leaves it out; bench/families_long.py):
one request of a 16,000-token prompt (token ids, the same for both), then 64 tokens of decode,
greedy: the KV bytes each server holds, TTFT and decode tokens/s.

`--check` measures nothing: it writes each shape's tiny file (fs.CHECK: a few MB, a byte
tokenizer) and loads it in wsllm's engine in this process, in seconds: every sampling setting gives
tokens, and a prompt of 8 windows holds less KV than full attention would. The unit test runs it.

    python bench/families.py                              # both shapes, both servers, 16k context
    python bench/families.py --shapes gpt-oss --layers 8 --no-long --no-write-docs
    python bench/families.py --tiny --no-write-docs       # the smoke: tiny shapes, a 2k prompt
    python bench/families.py --check                      # seconds: the files load in wsllm

Goals (issue 47): c=1 >= 1.2x and c=32 >= 2.5x llama-server on both shapes; at 16k context the
Gemma-3 shape holds less KV than llama-server and decodes at >= 1.2x its speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families_long as fl  # noqa: E402  (sibling scripts, not a package)
import family_shapes as fs  # noqa: E402
import random_gguf  # noqa: E402
import serving_peers  # noqa: E402
import serving_report  # noqa: E402

TITLE = "Gemma 3 and gpt-oss shapes: random-weight GGUFs (CPU)"


def shape_of(name: str, args: argparse.Namespace) -> fs.Shape:
    s = (fs.TINY if args.tiny else fs.SHAPES)[name]
    return replace(s, layers=args.layers) if isinstance(s, fs.GptOssShape) and args.layers else s


def gguf_path(s: fs.Shape, args: argparse.Namespace) -> Path:
    quant = "MXFP4-Q4_0" if isinstance(s, fs.GptOssShape) else "Q4_0"
    stem = f"{s.arch}{'-tiny' if args.tiny else ''}-{s.layers}l.{quant}"
    return fs.write(args.gguf_dir / f"{stem}.gguf", s, args.seed)


# -- the report -------------------------------------------------------------------------------------


def rows_text(
    s: fs.Shape, file_gib: float, rows: list[dict[str, Any]], levels: list[int], settings: list[str]
) -> str:
    """The shape's rows: each server under each sampling setting, then wsllm's ratios per setting."""
    label = f"{s.name} ({s.layers} layers)"
    lines = []
    for setting in settings:
        for r in rows:
            tps = [serving_report.tokens_per_s(r["runs"][setting][c]) for c in levels]
            cells = [label, r["name"], setting, f"{file_gib:.2f} GiB", *(f"{t:.1f}" for t in tps),
                     f"{r['peak_mb'] / 1024:.1f} GB"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        both = random_gguf.ratios(rows, levels, setting)
        if both is not None:
            cells = [label, "**wsllm / llama-server**", setting, "", *(f"**{x:.2f}x**" for x in both[0]),
                     f"**{both[1]:.2f}x**"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_agreement(s: fs.Shape, work: Path, stem: str) -> str | None:
    """How far the two servers' greedy answers to the first prompt agree (serving_peers.probe's
    files): a server that read the file otherwise than the other parts from it at once."""
    texts = []
    for name in ("wsllm", "llamacpp"):
        f = work / f"{name}-{stem}-probe.json"
        if not f.exists():
            return None
        texts.append(json.loads(f.read_text())["choices"][0]["message"]["content"] or "")
    a, b = texts
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"{s.name}: the greedy answers to the first prompt share their first {same} of {max(len(a), len(b))} characters"


def section(
    tables: list[str], agreements: list[str], long: str | None, args: argparse.Namespace, command: str
) -> str:
    head = ["shape", "server", "sampling", "file", *(f"tokens/s c={c}" for c in args.levels), "peak resident"]
    table = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3), *tables]
    parts = [
        f"## {TITLE}\n",
        "`bench/families.py`: random-weight GGUFs of Gemma-3-4B's shape (Q4_0, norms F32; 1024-token "
        "windows on 5 of 6 layers) and of gpt-oss-20b's layer shapes (MXFP4 experts, Q4_0 attention, "
        "embedding and output, F32 norms, router, biases and sinks; 128-token windows on every other "
        "layer), served by each server alone; `wsllm bench` chat prompts, "
        f"{args.num_requests} requests per level, {args.output_len} output tokens, `ignore_eos`, under "
        f"{serving_report.settings_text(args)}; both servers hold {args.ctx} tokens of KV." + (" **Tiny shapes: a smoke, not a measurement.**" if args.tiny else "") + "\n",
        f"```\n{command}\n```\n",
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({serving_report.cpu_model()}).\n",
    ]  # fmt: skip
    parts += ["\n".join(table) + "\n"] if tables else []
    parts += ["; ".join(agreements) + " (24 tokens each, 0 = parted at once).\n"] if agreements else []
    if long:
        parts += [
            f"Long context: llama-server `-c <prompt + {fl.LONG_SLACK}> -np 1 -ub 512` on /completion, its "
            "KV as its log allocates it (f16); wsllm's engine in-process with the same KV capacity (no "
            "HTTP route publishes its KV bytes), the KV its sequence holds at its most "
            "(EngineStats.kv_bytes_used) and its pool; full attention: every layer holding every token "
            f"at wsllm's KV dtype. Greedy, {args.output_len} output tokens.\n",
            long + "\n",
        ]
    parts += [
        "Goals (issue 47): c=1 at least 1.2x and c=32 at least 2.5x llama-server on both shapes; at 16k "
        "context less KV held than llama-server and decode at least 1.2x.\n",
        f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
    ]
    return "\n".join(parts)


def check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--check: each shape's tiny file (fs.CHECK) written and loaded in wsllm's engine in this process,
    in seconds. Per shape: the tokens of a short request under each sampling setting, and of a prompt
    of 8 windows (greedy) the KV held at most against full attention's. No server, no figure."""
    from wsllm.types import SamplingParams

    results = []
    for name in args.shapes:
        s = fs.CHECK[name]
        path = fs.write(args.gguf_dir / f"{s.arch}-check-{s.layers}l.gguf", s, args.seed)
        n, out_len = 8 * s.window, min(args.output_len, 8)
        engine = fl.engine_for(path, n + fl.LONG_SLACK, args)
        tokens = {}
        for j, setting in enumerate(args.samplings):
            knobs = {k: int(v) if k == "top_k" else v for k, v in serving_report.SAMPLINGS[setting].items()}
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, seed=args.seed, **knobs)
            ids = fl.long_prompt(16, args.seed + 1 + j, s.vocab)  # its own prompt: no prefix hit
            tokens[setting] = fl.timed_request(engine, setting, ids, params)["tokens"]
        greedy = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        long = fl.timed_request(engine, "long", fl.long_prompt(n, args.seed, s.vocab), greedy)
        elem = engine.cache.kv_caches[0][0].element_size()
        full = fs.full_attention_kv_bytes(s, n + out_len, elem)
        results.append({"shape": name, "path": path, "tokens": tokens, "prompt_tokens": n,
                        "long_tokens": long["tokens"], "kv_held": long["kv_held"], "kv_full": full})  # fmt: skip
        del engine
    return results


def check_failures(results: list[dict[str, Any]], out_len: int) -> list[str]:
    """What a check's results show wrong: a setting or the long prompt short of its tokens, or the
    windows holding no less KV than full attention."""
    bad = []
    for r in results:
        for setting, t in r["tokens"].items():
            bad += [f"{r['shape']} {setting}: {len(t)} tokens of {out_len}"] if len(t) != out_len else []
        if len(r["long_tokens"]) != out_len:
            bad.append(f"{r['shape']}: the long prompt gave {len(r['long_tokens'])} tokens of {out_len}")
        if not 0 < r["kv_held"] < r["kv_full"]:
            bad.append(f"{r['shape']}: {r['kv_held']} KV bytes held, full attention {r['kv_full']}")
    return bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from wsllm.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", default="gemma3,gpt-oss", help=f"comma list of {', '.join(fs.SHAPES)} (or none)"
    )
    p.add_argument("--layers", type=int, default=None, help="gpt-oss-20b: how many of its 24 layers (16)")
    p.add_argument("--servers", default="wsllm,llamacpp", help="comma list: wsllm,llamacpp")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--sampling", default="greedy,t0.7-p0.9",
                   help=f"comma list of settings, each at every level: {', '.join(serving_report.SAMPLINGS)}")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=None, help="per level (32; 8 with --tiny)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ctx", type=int, default=8192, help="KV tokens for both servers")
    p.add_argument("--long", action=argparse.BooleanOptionalAction, default=True,
                   help="the Gemma-3 shape at 16k tokens of context (default: on)")  # fmt: skip
    p.add_argument("--long-tokens", type=int, default=None, help="its prompt (16000; 2000 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="the smoke: tiny shapes of both families")
    p.add_argument("--check", action="store_true", help="no measurement: the tiny files load in wsllm")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf-dir", type=Path, default=cache_dir() / "bench")
    p.add_argument("--wsllm-args", default="")
    p.add_argument("--llama-args", default="")
    p.add_argument("--peers-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=None, help="keep logs and JSON here (default: a temp dir)")
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip() and s.strip() != "none"]
    if set(args.shapes) - set(fs.SHAPES):
        p.error(f"--shapes takes a comma list of {', '.join(fs.SHAPES)}")
    if args.layers is not None and not 1 <= args.layers <= fs.GPT_OSS_20B.layers:
        p.error(f"--layers takes 1 to {fs.GPT_OSS_20B.layers}")
    args.layers = args.layers or (None if args.tiny else 16)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers or set(args.servers) - {"wsllm", "llamacpp"}:
        p.error("--servers takes a comma list of wsllm, llamacpp")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.samplings = [x.strip() for x in args.sampling.split(",") if x.strip()]
    if not args.samplings or set(args.samplings) - set(serving_report.SAMPLINGS):
        p.error(f"--sampling takes a comma list of {', '.join(serving_report.SAMPLINGS)}")
    args.num_requests = args.num_requests or (8 if args.tiny else 32)
    args.long_tokens = args.long_tokens or (2000 if args.tiny else 16000)
    args.threads = args.threads or os.cpu_count() or 2
    args.probe = True  # each server's greedy answer to the first prompt, printed and kept
    return args


def run_check(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--check's results, printed a line a shape; SystemExit naming what failed."""
    results = check(args)
    for r in results:
        print(f"{r['shape']}: {r['path'].name} loads; " + ", ".join(f"{k} {v}" for k, v in r["tokens"].items())
              + f"; {r['prompt_tokens']} prompt tokens hold {r['kv_held']:,} KV bytes, full attention "
              f"{r['kv_full']:,} ({r['kv_held'] / r['kv_full']:.2f}x)")  # fmt: skip
    bad = check_failures(results, min(args.output_len, 8))
    if bad:
        raise SystemExit("check failed:\n" + "\n".join(bad))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.check:
        run_check(args)
        return
    command = shlex.join(["python", "bench/families.py", *(sys.argv[1:] if argv is None else argv)])
    tables, agreements, long = [], [], None
    with contextlib.ExitStack() as stack:
        work = args.out_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="families-bench-"))
        )
        work.mkdir(parents=True, exist_ok=True)
        serving_peers.write_prompts(args, work, len(args.samplings))
        for name in args.shapes:
            shape = shape_of(name, args)
            path = gguf_path(shape, args)
            if "wsllm" in args.servers:
                random_gguf.warm(path)
            rows = [random_gguf.measure(server, path, args, work, args.samplings) for server in args.servers]
            tables.append(rows_text(shape, path.stat().st_size / 2**30, rows, args.levels, args.samplings))
            agreement = probe_agreement(shape, work, path.stem)
            agreements += [agreement] if agreement else []
        if args.long:
            long = long_run(args, work)
    text = section(tables, agreements, long, args, command)
    print(text)
    if args.write_docs:
        random_gguf.write_docs_section(TITLE, text)


def long_run(args: argparse.Namespace, work: Path) -> str:
    """The Gemma-3 shape's long-context request on each server in turn (bench/families_long.py)."""
    gemma = shape_of("gemma3", args)
    assert isinstance(gemma, fs.Gemma3Shape)
    path = gguf_path(gemma, args)
    ids = fl.long_prompt(args.long_tokens, args.seed, min(gemma.vocab, fl.SMOLLM2_TOKENS))
    rows = []
    for server in args.servers:
        print(f"  {server}: one request of {len(ids)} prompt tokens", file=sys.stderr)
        if server == "wsllm":
            rows.append(fl.long_wsllm(path, gemma, ids, args))
        else:
            rows.append(fl.long_llamacpp(path, ids, args, work))
    return fl.long_text(gemma, rows)


if __name__ == "__main__":
    main()
