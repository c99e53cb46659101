"""LoRA adapters: throughput and c=1 speed of `wsllm serve` on the bundled model (Q4_1 GGUF) with
0, 1, 4 and 16 random adapters in the mix, for adapters of rank 8 and of rank 64 (every projection
adapted: q, k, v, o, gate, up, down), one server at a time; and the resident memory 16 adapters
add to a server beside their files' size.

Adapters are written here as PEFT writes them (`adapter_config.json`, `adapter_model.safetensors`)
with random weights of a small deviation; nothing is downloaded. For each rank one server holds 16
adapters (`--lora` x16 `--max-loras 16`); every cell sends `--requests-c1` (c=1) or `--requests-c32`
(c=32) completions of `--output-len` tokens (`ignore_eos`, greedy), each request's `model` the base
("0 adapters") or one of the first k adapters in turn (k = 1, 4, 16); output tokens/s is their
completion tokens over the cell's wall time, the best of `--repeat` runs. The ratios are each cell
over the base-only cell of the same server and concurrency. Memory: the server's resident set (its
process tree, bench/procmem.py) after one request, with no adapter and with the 16, against the 16
files' bytes.

    python bench/lora.py                    # both ranks, writes the "LoRA adapters" section (~15 min)
    python bench/lora.py --ranks 8 --repeat 1 --no-write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import procmem  # noqa: E402  (sibling scripts, not a package)
import serving_peers as sp  # noqa: E402
import serving_report  # noqa: E402

ROOT = sp.ROOT
TITLE = "LoRA adapters"
MIXES = (0, 1, 4, 16)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, cfg: dict[str, Any], rank: int, seed: int) -> int:
    """A random PEFT LoRA adapter of every projection of the base of HF config `cfg`; its bytes."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    q, kv = heads * d, cfg.get("num_key_value_heads", heads) * d
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            fan_in, fan_out = dims[m]
            part = "self_attn" if m in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
              "bias": "none", "lora_dropout": 0.0, "base_model_name_or_path": "SmolLM2-135M-Instruct"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return sum(f.stat().st_size for f in path.iterdir())


async def one(client: httpx.AsyncClient, base: str, model: str, prompt: str, length: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": length, "temperature": 0.0, "ignore_eos": True}
    r = await client.post(f"{base}/v1/completions", json=body)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def cell(port: int, models: list[str], level: int, n: int, length: int) -> float:
    """Output tokens/s of `n` completions, `level` at a time, their models in turn."""
    base = f"http://127.0.0.1:{port}"
    prompts = [f"Write a short story about the number {i}, in plain words." for i in range(n)]
    queue = list(enumerate(prompts))
    total = 0
    limits = httpx.Limits(max_connections=level, max_keepalive_connections=level)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal total
            while queue:
                i, p = queue.pop(0)
                got = await one(client, base, models[i % len(models)], p, length)
                total += got  # after the await: `total += await ...` reads total before it

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(level)))
        return total / (time.perf_counter() - start)


def serve(port: int, adapters: list[tuple[str, Path]], args: argparse.Namespace) -> sp.Server:
    flags = [f for name, path in adapters for f in ("--lora", f"{name}={path}")]
    flags += ["--max-loras", str(max(len(adapters), 1)), *shlex.split(args.wsllm_args)]
    ns = argparse.Namespace(wsllm_args=shlex.join(flags), ready_timeout_s=args.ready_timeout_s, levels=[32],
                            output_len=args.output_len + 64)  # fmt: skip
    return sp.make_server("wsllm", port, ns)


def measure_rank(rank: int, adapters: list[tuple[str, Path]], args: argparse.Namespace, work: Path) -> dict:
    """{(mix, level): tokens/s}, and the server's resident MB after one request."""
    port = sp.free_port()
    out: dict[Any, Any] = {}
    with sp.running(serve(port, adapters, args), port, work / f"rank{rank}.log") as (_, pid):
        asyncio.run(cell(port, ["a0"], 1, 1, 4))
        out["rss_mb"] = procmem.tree_rss_mb(pid)
        # a first batch of 32 runs far slower than the next (measured 11-16 s for 32 x 16 tokens, then
        # 0.4 s): warm the server up with every adapter before any cell counts
        asyncio.run(cell(port, [a for a, _ in adapters], 32, 64, 8))
        for _ in range(args.repeat):
            for level in (1, 32):
                n = args.requests_c1 if level == 1 else args.requests_c32
                for mix in MIXES:
                    models = ["SmolLM2-135M-Instruct"] if mix == 0 else [a for a, _ in adapters[:mix]]
                    tps = asyncio.run(cell(port, models, level, n, args.output_len))
                    print(f"  rank {rank} mix {mix} c={level}: {tps:.1f} tokens/s", file=sys.stderr)
                    out[(mix, level)] = max(out.get((mix, level), 0.0), tps)
    return out


def base_rss(args: argparse.Namespace, work: Path) -> float:
    port = sp.free_port()
    with sp.running(serve(port, [], args), port, work / "base.log") as (_, pid):
        asyncio.run(cell(port, ["SmolLM2-135M-Instruct"], 1, 1, 4))
        return procmem.tree_rss_mb(pid)


def report(
    rows: dict[int, dict], sizes: dict[int, int], rss0: float, args: argparse.Namespace, command: str
) -> str:
    head = "| rank | c | " + " | ".join(f"{m} adapters" for m in MIXES) + " | ratios to base-only |"
    lines = [head, "| ---: | ---: |" + " ---: |" * (len(MIXES) + 1)]
    for rank, r in rows.items():
        for level in (1, 32):
            base = r[(0, level)]
            ratios = " / ".join(f"{r[(m, level)] / base:.2f}x" for m in MIXES[1:])
            lines.append(
                f"| {rank} | {level} | "
                + " | ".join(f"{r[(m, level)]:.1f}" for m in MIXES)
                + f" | {ratios} |"
            )
    mem = [f"no adapter {rss0:.0f} MB"]
    for rank, r in rows.items():
        grew, files = r["rss_mb"] - rss0, sizes[rank] / 2**20
        mem.append(
            f"16 of rank {rank}: {r['rss_mb']:.0f} MB (+{grew:.0f} MB for {files:.0f} MB of files, {grew / files:.2f}x)"
        )
    return "\n".join(
        [
            f"## {TITLE}\n",
            "`bench/lora.py` (its docstring says how): `wsllm serve` on the bundled SmolLM2-135M (Q4_1 GGUF) "
            "holding 16 random adapters of every projection, output tokens/s with 0 (base only), 1, 4 and 16 "
            f"adapters in the mix, {args.output_len}-token completions (`ignore_eos`), {args.requests_c1} "
            f"requests at c=1 and {args.requests_c32} at c=32, the best of {args.repeat} runs.\n",
            f"```\n{command}\n```\n",
            f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({serving_report.cpu_model()}).\n",
            "\n".join(lines) + "\n",
            "Resident memory after one request: " + "; ".join(mem) + ".\n",
            f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--repeat", type=int, default=2, help="runs per cell; the best counts")
    p.add_argument("--requests-c1", type=int, default=6)
    p.add_argument("--requests-c32", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--wsllm-args", default="", help="more `wsllm serve` flags")
    p.add_argument("--out-dir", type=Path, default=None, help="keep the adapters and logs here")
    p.add_argument("--ready-timeout-s", type=float, default=None)
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/lora.py", *(sys.argv[1:] if argv is None else argv)])
    from wsllm.models.loader import read_hf_config, resolve_model_dir

    cfg = read_hf_config(resolve_model_dir(None, weights=False))
    with contextlib.ExitStack() as stack:
        work = args.out_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lora-bench-")))
        work.mkdir(parents=True, exist_ok=True)
        rss0 = base_rss(args, work)
        rows, sizes = {}, {}
        for rank in args.ranks:
            adapters = [(f"a{i}", work / f"r{rank}-a{i}") for i in range(16)]
            sizes[rank] = sum(write_adapter(path, cfg, rank, seed) for seed, (_, path) in enumerate(adapters))
            rows[rank] = measure_rank(rank, adapters, args, work)
    text = report(rows, sizes, rss0, args, command)
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        path.write_text(serving_report.replace_section(path.read_text(), TITLE, text))
        print(f"wrote the '{TITLE}' section of {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
