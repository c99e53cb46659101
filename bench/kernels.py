"""Paged decode attention against torch SDPA on the same data laid out contiguously.

For batch x context in {1, 16, 64, 256} x {128, 1024, 4096} (every sequence the
same length, so the contiguous peer carries no padding), it times
`paged_decode_attention_triton` reading a shuffled paged cache through block
tables, and `F.scaled_dot_product_attention` reading [batch, kv_heads, context,
head_dim] copies of the same K and V. Bytes counted for both: K and V of every
context token, plus q and the output; the block table is counted for paged only.

Both are timed as the engine runs the kernel, inside a CUDA graph (50 calls a replay, each
after a write of 256 MB that flushes L2, the flushes' own time subtracted; the median of 5
replays): launch cost from Python is not the kernel's. The paged kernel is also timed as a
plain call (triton.testing.do_bench, L2 flushed), the eager engine's cost. GB/s is the
bytes over the graph time; "% peak" divides by the device's peak HBM bandwidth.

    .venv/bin/python bench/kernels.py [--heads 32 --kv-heads 8 --head-dim 128]
        [--block-size 16] [--dtype bf16] [--peak-gbps N] [--markdown FILE] [--json FILE]
    .venv/bin/python bench/kernels.py --dry-run   # the CPU, Triton's interpreter, tiny shapes

Needs CUDA and triton; without them it says so and exits 0 (`--dry-run` checks the paged
kernel against SDPA on tiny shapes, no timing). It prints, never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import peak_gbps  # noqa: E402

BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 1024, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class Row:
    batch: int
    context: int
    kv_mib: float
    paged_us: float | None  # in a CUDA graph
    paged_gbps: float | None
    sdpa_us: float | None
    sdpa_gbps: float | None
    paged_eager_us: float | None  # a plain call from Python
    splits: int
    max_err: float


def _time_us(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _graph_us(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    """One call's time inside a CUDA graph of `reps` calls, each after an L2 flush, the
    flushes' own graph subtracted; the median of 5 replays."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # past any L2 (H200: 60 MB)

    def replay_ms(with_fn: bool) -> float:
        def body() -> None:
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[2]

    return (replay_ms(True) - replay_ms(False)) / reps * 1e3


def run_one(batch: int, context: int, args: argparse.Namespace, gen: torch.Generator) -> Row:
    from wsllm.kernels.paged_attention import paged_decode_attention_triton
    from wsllm.kernels.paged_decode import plan_splits

    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    hk, d, bs = args.kv_heads, args.head_dim, args.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    # The paged cache, with each sequence's blocks scattered over the pool.
    k_cache = torch.randn(num_blocks, bs, hk, d, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, bs, hk, d, device=dev, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, args.heads, d, device=dev, dtype=dtype, generator=gen)
    scale = d**-0.5

    # The peer's layout: [batch, kv_heads, context, head_dim], gathered once, off the clock.
    k_seq = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v_seq = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q_sdpa = q.unsqueeze(2)  # [batch, heads, 1, head_dim]

    def paged() -> torch.Tensor:
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k_seq, v_seq, scale=scale, enable_gqa=True)

    max_err = (paged().float() - sdpa().squeeze(2).float()).abs().max().item()
    kv_bytes = 2 * batch * context * hk * d * k_cache.element_size()
    qo_bytes = 2 * q.numel() * q.element_size()
    paged_bytes = kv_bytes + qo_bytes + tables.numel() * tables.element_size()
    timed = dev.type == "cuda"
    paged_us, sdpa_us = (_graph_us(paged), _graph_us(sdpa)) if timed else (None, None)
    return Row(
        batch=batch,
        context=context,
        kv_mib=kv_bytes / 2**20,
        paged_us=paged_us,
        paged_gbps=paged_bytes / paged_us / 1e3 if paged_us else None,
        sdpa_us=sdpa_us,
        sdpa_gbps=(kv_bytes + qo_bytes) / sdpa_us / 1e3 if sdpa_us else None,
        paged_eager_us=_time_us(paged) if timed else None,
        splits=plan_splits(batch, hk, blocks_per_seq * bs, dev),
        max_err=max_err,
    )


def render(rows: list[Row], peak: float | None, header: str) -> str:
    def f(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    def pct(gbps: float | None) -> str:
        return f"{100 * gbps / peak:.0f}%" if peak and gbps else "n/a"

    lines = [
        header,
        "",
        "| batch | context | KV MiB | splits | paged µs | paged GB/s | % peak | SDPA µs | SDPA GB/s "
        "| SDPA % peak | paged speed vs SDPA | paged µs, plain call | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r.sdpa_us / r.paged_us if r.sdpa_us and r.paged_us else None
        lines.append(
            f"| {r.batch} | {r.context} | {r.kv_mib:.1f} | {r.splits} | {f(r.paged_us, '.1f')} "
            f"| {f(r.paged_gbps, '.0f')} | {pct(r.paged_gbps)} | {f(r.sdpa_us, '.1f')} | {f(r.sdpa_gbps, '.0f')} "
            f"| {pct(r.sdpa_gbps)} | {f(ratio, '.2f')}{'x' if ratio else ''} | {f(r.paged_eager_us, '.1f')} "
            f"| {r.max_err:.1e} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=32, help="query heads (default: Llama-3-8B's 32)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth, GB/s")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", default=None, help="also append the table to this file")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--dry-run", action="store_true", help="the CPU, the interpreter, tiny shapes, no timing")
    args = p.parse_args(argv)
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:  # shapes the interpreter runs in seconds
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 32, "fp32"
        args.batches, args.contexts = [1, 3], [64, 200]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
    elif not torch.cuda.is_available():
        print(
            "bench/kernels.py needs a CUDA GPU (the Triton kernels compile for it); none found, nothing to do."
        )
        return 0
    try:
        import triton
    except ImportError:
        print("bench/kernels.py needs triton (pip install -e '.[triton]'); not installed, nothing to do.")
        return 0
    from tqdm import tqdm

    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run, interpreter)"
    peak = peak_gbps(name, args.peak_gbps)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    shapes = [(b, c) for b in args.batches for c in args.contexts]
    rows = []
    for b, c in tqdm(shapes, desc="paged decode", unit="shape"):
        rows.append(run_one(b, c, args, gen))
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the next shape's caches may be 4 GiB each
    command = "python bench/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (
        f"Paged decode, {name} (peak {peak or 'unknown'} GB/s), {date.today().isoformat()}, "
        f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}; "
        f"heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, block {args.block_size}, "
        f"{args.dtype}. Command: `{command.strip()}`"
    )
    table = render(rows, peak, header)
    print(table)
    if peak is None and args.device == "cuda":
        print(f"(no peak bandwidth known for {name!r}: pass --peak-gbps for the % columns)")
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(table + "\n\n")
    if args.json:
        meta = {"device": name, "peak_gbps": peak, "command": command.strip()}
        Path(args.json).write_text(
            json.dumps({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
