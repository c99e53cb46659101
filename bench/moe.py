"""Mixtures of experts on the CPU: wsllm serve against llama-server on the same random-weight Q4_0 GGUF.

Two shapes (`SHAPES`): OLMoE-1B-7B's whole model (16 layers, 64 experts, top-8) and Qwen3-30B-A3B's
layers (128 experts, top-8, QK-norm per head) with a given number of its 48 layers (`--layers`, so that
it fits the machine). Each GGUF has random weights: Q4_0 blocks (random nibbles, fp16 scales that
put the weights near N(0, 0.02)) for every linear layer, the experts, the embedding and the output;
the router and the norms F32; the bundled SmolLM2 tokenizer padded with unused tokens to the shape's
vocabulary, so both servers read the prompts alike. A file is written once (streamed).

Each server is started alone, measured and stopped (never two at once): `wsllm bench` chat prompts,
greedy, `ignore_eos`, at c = 1, 8 and 32; the peak resident memory of its process tree; and the weight
bandwidth at c = 1: the bytes of weights one token reads (the attention, the router, its top-k
experts' gate/up/down, the output layer; `weight_bytes_per_token`) times tokens/s, beside the
machine's stream bandwidth measured in the same run (a 2 GiB float32 sum on every core, best of 5).
The table and the CPU's flags go into docs/benchmarks.md.

    python bench/moe.py                                  # both shapes, both servers
    python bench/moe.py --shapes olmoe --servers wsllm --no-write-docs
    python bench/moe.py --layers 12                      # Qwen3-30B-A3B: 12 of its 48 layers

Goals (issue 42): c=1 >= 1.3x and c=32 >= 3x llama-server on both shapes; at c=1 the weights stream at
>= 80% of the measured bandwidth; resident memory at most llama-server's + 15%.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_gguf  # noqa: E402  (sibling scripts, not a package)
import serving_peers  # noqa: E402
import serving_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Mixtures of experts: OLMoE and Qwen3-30B-A3B shapes, Q4_0 GGUF (CPU)"


@dataclass(frozen=True, slots=True)
class MoeShape:
    name: str
    arch: str  # GGUF general.architecture
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ff: int
    qk_norm: str  # "full" (OLMoE: over q's and k's widths) | "head" (Qwen3: per head)
    rope_theta: float
    ctx: int = 4096
    norm_topk: bool = False


SHAPES = {
    "olmoe": MoeShape("OLMoE-1B-7B", "olmoe", 50304, 2048, 16, 16, 16, 128, 64, 8, 1024, "full", 10000.0),
    "qwen3moe": MoeShape(
        "Qwen3-30B-A3B layers",
        "qwen3moe",
        151936,
        2048,
        48,
        32,
        4,
        128,
        128,
        8,
        768,
        "head",
        1e6,
        norm_topk=True,
    ),  # fmt: skip
}


def q4_0_bytes(rows: int, cols: int) -> int:
    return random_gguf.nbytes("Q4_0", (rows, cols))


def tensors(s: MoeShape) -> list[random_gguf.Spec]:
    """(GGUF name, format, shape in row order) in llama.cpp's order."""
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    norms = (q, kv) if s.qk_norm == "full" else (s.head_dim, s.head_dim)
    out: list[random_gguf.Spec] = [("token_embd.weight", "Q4_0", (s.vocab, h))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", "F32", (h,)),
            (b + "attn_q.weight", "Q4_0", (q, h)),
            (b + "attn_k.weight", "Q4_0", (kv, h)),
            (b + "attn_v.weight", "Q4_0", (kv, h)),
            (b + "attn_output.weight", "Q4_0", (h, q)),
            (b + "attn_q_norm.weight", "F32", (norms[0],)),
            (b + "attn_k_norm.weight", "F32", (norms[1],)),
            (b + "ffn_norm.weight", "F32", (h,)),
            (b + "ffn_gate_inp.weight", "F32", (s.experts, h)),
            (b + "ffn_gate_exps.weight", "Q4_0", (s.experts, s.expert_ff, h)),
            (b + "ffn_up_exps.weight", "Q4_0", (s.experts, s.expert_ff, h)),
            (b + "ffn_down_exps.weight", "Q4_0", (s.experts, h, s.expert_ff)),
        ]
    return out + [("output_norm.weight", "F32", (h,)), ("output.weight", "Q4_0", (s.vocab, h))]


def weight_bytes_per_token(s: MoeShape) -> int:
    """Bytes of weights one token reads at batch 1: every layer's attention, norms and router, its
    top-k experts' three projections; the output layer and one embedding row."""
    total = q4_0_bytes(1, s.hidden)  # its embedding row
    for name, qtype, shape in tensors(s):
        if name == "token_embd.weight":
            continue
        n = int(np.prod(shape))
        if "_exps" in name:
            n = n // s.experts * s.top_k
        total += random_gguf.nbytes(qtype, (n,))
    return total


def _add_metadata(w: Any, s: MoeShape) -> None:
    import gguf

    w.add_block_count(s.layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.expert_ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s.vocab)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_expert_weights_norm(s.norm_topk)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    random_gguf.add_tokenizer(w, s.vocab)


def _fill(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("ffn_gate_inp.weight"):  # a router that spreads the tokens over the experts
        return rng.normal(0, 0.05, size=shape).astype(np.float32)
    return rng.uniform(0.8, 1.2, size=shape).astype(np.float32)


def write_gguf(path: Path, s: MoeShape, seed: int = 0) -> Path:
    """The shape's random-weight Q4_0 GGUF at `path`, written once, tensor by tensor."""
    return random_gguf.write_gguf(
        path, s.arch, f"random {s.name} Q4_0", lambda w: _add_metadata(w, s), tensors(s), _fill, seed
    )


def stream_gbps(gib: float = 2.0, repeats: int = 5) -> float:
    """The machine's read bandwidth: a float32 sum over `gib` GiB on every core, best of `repeats`."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def rows_text(
    shape: MoeShape, file_gib: float, rows: list[dict[str, Any]], levels: list[int], gbps: float
) -> str:
    per_token = weight_bytes_per_token(shape)
    lines = []
    for r in rows:
        tps = [serving_report.tokens_per_s(r["runs"]["greedy"][c]) for c in levels]
        bw = per_token * tps[0] / 1e9 if levels[0] == 1 else float("nan")
        cells = [f"{shape.name} ({shape.layers} layers)", str(r["name"]), f"{file_gib:.2f} GiB",
                 f"{per_token / 1e9:.2f} GB", *(f"{t:.1f}" for t in tps), f"{r['peak_mb'] / 1024:.1f} GB",
                 f"{bw:.1f} GB/s ({bw / gbps:.0%})"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    both = random_gguf.ratios(rows, levels)
    if both is not None:
        ratio, rss = both
        cells = [shape.name, "**wsllm / llama-server**", "", "", *(f"**{x:.2f}x**" for x in ratio),
                 f"**{rss:.2f}x**", ""]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section(tables: list[str], args: argparse.Namespace, command: str, gbps: float) -> str:
    head = ["shape", "server", "file", "weights read a token", *(f"tokens/s c={c}" for c in args.levels),
            "peak resident", "weight bandwidth at c=1"]  # fmt: skip
    table = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2), *tables]
    return "\n".join([
        f"## {TITLE}\n",
        "`bench/moe.py`: random-weight Q4_0 GGUFs (the router and norms F32) of OLMoE-1B-7B's shape and of "
        "Qwen3-30B-A3B's layer shapes, served by each server alone; `wsllm bench` chat prompts, "
        f"{args.num_requests} requests per level, {args.output_len} output tokens, greedy, `ignore_eos`; both "
        f"servers hold {args.ctx} tokens of KV. Weight bandwidth: the bytes of weights one token reads at "
        "batch 1 times tokens/s at c=1, and its share of the machine's stream bandwidth measured in the same "
        f"run ({gbps:.1f} GB/s: a 2 GiB float32 sum on every core, best of 5).\n",
        f"```\n{command}\n```\n",
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({serving_report.cpu_model()}).\n",
        "\n".join(table) + "\n",
        "Goals (issue 42): c=1 at least 1.3x and c=32 at least 3x llama-server, the c=1 bandwidth at least 80% "
        "of the stream's, resident memory at most llama-server's + 15%.\n",
        f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
    ])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from wsllm.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="olmoe,qwen3moe", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=12, help="Qwen3-30B-A3B: how many of its 48 layers")
    p.add_argument("--servers", default="wsllm,llamacpp", help="comma list: wsllm,llamacpp")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ctx", type=int, default=8192, help="KV tokens for both servers")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf-dir", type=Path, default=cache_dir() / "bench")
    p.add_argument("--wsllm-args", default="")
    p.add_argument("--llama-args", default="")
    p.add_argument("--peers-dir", type=Path, default=None)
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if set(args.shapes) - set(SHAPES):
        p.error(f"--shapes takes a comma list of {', '.join(SHAPES)}")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.threads = args.threads or os.cpu_count() or 2
    return args


def shape_of(name: str, args: argparse.Namespace) -> MoeShape:
    return replace(SHAPES[name], layers=args.layers) if name == "qwen3moe" else SHAPES[name]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "bench/moe.py", *(sys.argv[1:] if argv is None else argv)])
    gbps = stream_gbps()
    print(f"stream bandwidth {gbps:.1f} GB/s", file=sys.stderr)
    tables = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-bench-")))
        serving_peers.write_prompts(args, work)
        for name in args.shapes:
            shape = shape_of(name, args)
            path = write_gguf(args.gguf_dir / f"{name}-{shape.layers}l.Q4_0.gguf", shape, args.seed)
            if "wsllm" in args.servers:
                random_gguf.warm(path)
            rows = [random_gguf.measure(server, path, args, work) for server in args.servers]
            tables.append(rows_text(shape, path.stat().st_size / 2**30, rows, args.levels, gbps))
    text = section(tables, args, command, gbps)
    print(text)
    if args.write_docs:
        random_gguf.write_docs_section(TITLE, text)


if __name__ == "__main__":
    main()
