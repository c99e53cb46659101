"""A model the size of Llama-3-8B in Q4_K_M-like formats, served by wsllm and by llama-server.

The GGUF has Llama-3-8B's shapes (32 layers, hidden 4096, FFN 14336, 32 heads of 128, 8 KV
heads, a 128256-token untied vocabulary, rope theta 500000) and random weights in the formats
llama.cpp's Q4_K_M gives such a model: Q4_K for most linear layers and the embedding, Q6_K for
attn_v, ffn_down and the output layer (llama.cpp gives Q6_K to only half of the attn_v and
ffn_down layers; all of them here, a slightly larger file). Neither the gguf package nor the
kernels quantize to K formats, and random weights need no search: each block is random bytes
with its fp16 super-block scales set so the weights come out near N(0, 0.02). The tokenizer is
SmolLM2's (from the bundled GGUF) padded with unused tokens to 128256, so both servers read the
prompts the same way. The file (about 5 GB) is written once, streamed tensor by tensor.

Each server is started alone, measured and stopped: the seconds until it answers, tokens/s of
`wsllm bench` at c=1 and c=8 (chat prompts, greedy, `ignore_eos`), and the peak resident
memory of its process tree while it ran. wsllm repacks the GGUF once (cached) before its timed
start, as `make serve` would have; both get the same KV capacity (llama-server's `-c`).

    python bench/big_model.py                     # both servers; writes docs/benchmarks.md
    python bench/big_model.py --servers wsllm --no-write-docs
    python bench/big_model.py --llama-args="-lm none"   # llama-server reading, not mapping, the file

Time on 2 cores (a busy machine's smoke runs): writing the GGUF ~30 s and wsllm's repack
1.5-4.5 min (75 s of CPU, peak 1.2 GB), both once; then each server 6-30 s to ready plus its
load (8 requests x 32 tokens per level at a few tokens/s: minutes). 23 GB of RAM is enough
(peaks: wsllm 5.6 GB, llama-server 8.2 GB with its defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_setup  # noqa: E402  (sibling scripts, not a package)
import procmem  # noqa: E402
import serving_peers  # noqa: E402
import serving_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Big model: Llama-3-8B shapes, Q4_K_M-like GGUF (CPU)"
SHAPES = dict(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, ctx=8192)
Q6_K_TENSORS = ("attn_v", "ffn_down", "output")


def _random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 256 * type_size] of random K-quant super-blocks with sane scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin (fp16) lead the block: w = d * scale * q - dmin * min, q < 16, scale < 64
        raw[..., 0:2] = np.frombuffer(np.float16(0.02 / (63 * 8)).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(0.02 / 63).tobytes(), np.uint8)
    else:  # Q6_K: d (fp16) ends the block: w = d * int8 scale * (q - 32)
        raw[..., size - 2 : size] = np.frombuffer(np.float16(0.02 / (64 * 16)).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def _tensors() -> list[tuple[str, str | None, tuple[int, int] | tuple[int]]]:
    """(GGUF name, K format or None for F32, (rows, cols) or (n,)) in llama.cpp's order."""
    s = SHAPES
    hd = s["hidden"] // s["heads"]
    out: list[tuple[str, str | None, tuple[int, int] | tuple[int]]] = [
        ("token_embd.weight", "Q4_K", (s["vocab"], s["hidden"]))
    ]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", None, (s["hidden"],)),
            (b + "attn_q.weight", "Q4_K", (s["heads"] * hd, s["hidden"])),
            (b + "attn_k.weight", "Q4_K", (s["kv_heads"] * hd, s["hidden"])),
            (b + "attn_v.weight", "Q6_K", (s["kv_heads"] * hd, s["hidden"])),
            (b + "attn_output.weight", "Q4_K", (s["hidden"], s["heads"] * hd)),
            (b + "ffn_norm.weight", None, (s["hidden"],)),
            (b + "ffn_gate.weight", "Q4_K", (s["ffn"], s["hidden"])),
            (b + "ffn_up.weight", "Q4_K", (s["ffn"], s["hidden"])),
            (b + "ffn_down.weight", "Q6_K", (s["hidden"], s["ffn"])),
        ]
    out += [
        ("output_norm.weight", None, (s["hidden"],)),
        ("output.weight", "Q6_K", (s["vocab"], s["hidden"])),
    ]
    return out


def _add_metadata(w: object, tokenizer_gguf: Path) -> None:
    import gguf

    s = SHAPES
    w.add_block_count(s["layers"])  # type: ignore[attr-defined]
    w.add_context_length(s["ctx"])  # type: ignore[attr-defined]
    w.add_embedding_length(s["hidden"])  # type: ignore[attr-defined]
    w.add_feed_forward_length(s["ffn"])  # type: ignore[attr-defined]
    w.add_head_count(s["heads"])  # type: ignore[attr-defined]
    w.add_head_count_kv(s["kv_heads"])  # type: ignore[attr-defined]
    w.add_rope_freq_base(500000.0)  # type: ignore[attr-defined]
    w.add_layer_norm_rms_eps(1e-5)  # type: ignore[attr-defined]
    w.add_rope_dimension_count(s["hidden"] // s["heads"])  # type: ignore[attr-defined]
    w.add_vocab_size(s["vocab"])  # type: ignore[attr-defined]
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)  # type: ignore[attr-defined]
    f = gguf.GGUFReader(str(tokenizer_gguf)).fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    types = list(f["tokenizer.ggml.token_type"].contents())
    pad = s["vocab"] - len(tokens)
    w.add_tokenizer_model(f["tokenizer.ggml.model"].contents())  # type: ignore[attr-defined]
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())  # type: ignore[attr-defined]
    w.add_token_list(tokens + [f"[unused{i}]" for i in range(pad)])  # type: ignore[attr-defined]
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)  # type: ignore[attr-defined]
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())  # type: ignore[attr-defined]
    for key, add in (
        ("bos", "add_bos_token_id"),
        ("eos", "add_eos_token_id"),
        ("padding", "add_pad_token_id"),
    ):
        getattr(w, add)(int(f[f"tokenizer.ggml.{key}_token_id"].contents()))
    w.add_add_bos_token(False)  # type: ignore[attr-defined]
    w.add_chat_template(f["tokenizer.chat_template"].contents())  # type: ignore[attr-defined]


def write_gguf(path: Path, seed: int = 0) -> Path:
    """The random-weight GGUF at `path`, written once (streamed: never all in memory)."""
    import gguf
    from tqdm import tqdm

    from wsllm.models.loader import default_gguf_path

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("random Llama-3-8B shapes Q4_K_M")
    _add_metadata(w, default_gguf_path())
    rng = np.random.default_rng(seed)
    specs = _tensors()
    for name, q, shape in specs:
        if q is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            rows, cols = shape  # type: ignore[misc]
            nbytes = rows * cols // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]][1]
            byte_shape = (rows, nbytes // rows)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType[q])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, q, shape in tqdm(specs, desc=f"writing {path.name}"):
        if q is None:
            w.write_tensor_data(rng.uniform(0.8, 1.2, size=shape).astype(np.float32))
        else:
            w.write_tensor_data(_random_blocks(rng, q, *shape))  # type: ignore[misc]
    w.close()
    tmp.rename(path)
    return path


def server_argv(name: str, gguf_path: Path, port: int, args: argparse.Namespace) -> list[str]:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "wsllm":
        return [str(Path(sys.executable).parent / "wsllm"), "serve", "--model", str(gguf_path), *host,
                "--no-frontend", "--num-kv-blocks", str(args.ctx // 16), *shlex.split(args.wsllm_args)]  # fmt: skip
    binary = peers_setup.llama_server_path(args.peers_dir)
    if not binary.exists():
        raise SystemExit(f"llama-server is not built: {binary} is missing; run python bench/peers_setup.py")
    return [str(binary), "-m", str(gguf_path), *host, "-np", str(max(args.levels)), "-c", str(args.ctx),
            "-t", str(args.threads), "--alias", gguf_path.stem, *shlex.split(args.llama_args)]  # fmt: skip


def measure(name: str, gguf_path: Path, args: argparse.Namespace, work: Path) -> dict[str, object]:
    port = serving_peers.free_port()
    ready_path = "/ready" if name == "wsllm" else "/health"
    server = serving_peers.Server(name, name, server_argv(name, gguf_path, port, args), ready_path, 1800)
    runs = {}
    with serving_peers.running(server, port, work / f"{name}.log") as (ready_s, pid):
        with procmem.PeakSampler(pid) as sampler:
            for i, level in enumerate(args.levels):
                print(f"  {name}: concurrency {level}, {args.num_requests} requests", file=sys.stderr)
                runs[level] = serving_peers.bench_level(
                    port, level, work / f"prompts-{i}.jsonl", args, work / f"{name}-c{level}.json"
                )
        peak = max(sampler.peak_mb, procmem.tree_hwm_mb(pid))
    return {"name": name, "ready_s": ready_s, "runs": runs, "peak_mb": peak}


def section(rows: list[dict[str, object]], args: argparse.Namespace, command: str, gguf_path: Path) -> str:
    head = ["server", *(f"tokens/s c={c}" for c in args.levels), "peak resident MB", "ready in (s)"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        runs: dict[int, dict[str, object]] = r["runs"]  # type: ignore[assignment]
        cells = [str(r["name"]), *(f"{serving_report.tokens_per_s(runs[c]):.2f}" for c in args.levels),
                 f"{r['peak_mb']:.0f}", f"{r['ready_s']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    by = {str(r["name"]): r for r in rows}
    ratio = ""
    if {"wsllm", "llamacpp"} <= set(by):
        ws, lc = by["wsllm"], by["llamacpp"]
        speed = ", ".join(
            f"c={c} **{serving_report.tokens_per_s(ws['runs'][c]) / serving_report.tokens_per_s(lc['runs'][c]):.2f}x**"  # type: ignore[index]
            for c in args.levels
        )
        ratio = (
            f"wsllm / llama-server: tokens/s {speed}; peak resident memory "
            f"**{float(ws['peak_mb']) / float(lc['peak_mb']):.2f}x** (goal: at most 1.15x, c=1 at least 1.0x); "  # type: ignore[arg-type]
            f"ready in {float(ws['ready_s']):.1f} s against {float(lc['ready_s']):.1f} s.\n"  # type: ignore[arg-type]
        )
    kv_dtype, kv_bytes = _kv_dtype()
    return "\n".join(
        [
            f"## {TITLE}\n",
            f"`bench/big_model.py`: a random-weight GGUF with Llama-3-8B's shapes ({gguf_path.stat().st_size / 2**30:.2f} GiB; "
            "Q4_K, with Q6_K for attn_v, ffn_down and output), served by each server alone; `wsllm bench` chat "
            f"prompts, {args.num_requests} requests per level, {args.output_len} output tokens, greedy, `ignore_eos`; "
            f"both servers hold {args.ctx} tokens of KV (wsllm {args.ctx // 16} blocks of 16 in {kv_dtype}, "
            f"{_kv_mb(args.ctx, kv_bytes):.0f} MB; llama-server `-c {args.ctx}` in f16, {_kv_mb(args.ctx, 2):.0f} MB). "
            "Peak resident memory: the server's process tree, sampled every 0.2 s while it loads and serves "
            "(each server maps the weights' file: its pages count once read; llama-server also keeps the "
            "copies it repacks for its CPU kernels beside the mapped file).\n",
            f"```\n{command}\n```\n",
            f"{datetime.date.today().isoformat()}, {serving_report.cpu_model()}.\n",
            "\n".join(lines) + "\n",
            ratio,
            f"CPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{serving_report.cpu_flags()}\n```",
        ]
    )


def _kv_mb(tokens: int, elem_bytes: int) -> float:
    s = SHAPES
    return 2 * s["layers"] * tokens * s["kv_heads"] * (s["hidden"] // s["heads"]) * elem_bytes / 2**20


def _kv_dtype() -> tuple[str, int]:
    """wsllm's KV dtype here and its bytes: the engine's dtype (auto: bf16 where the CPU has
    it natively, else fp32)."""
    import torch

    from wsllm.models.build import cpu_flags, pick_dtype

    dtype, _ = pick_dtype("auto", torch.device("cpu"), cpu_flags())
    return str(dtype).removeprefix("torch."), dtype.itemsize


def main(argv: list[str] | None = None) -> None:
    from wsllm.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="wsllm,llamacpp", help="comma list: wsllm,llamacpp")
    p.add_argument("--gguf", type=Path, default=cache_dir() / "bench" / "llama3-8b-shapes.Q4_K_M.gguf")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ctx", type=int, default=4096, help="KV tokens for both servers")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: the cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wsllm-args", default="")
    p.add_argument(
        "--llama-args",
        default="",
        help='extra args for llama-server, e.g. --llama-args="-lm none" (read, not mmap)',
    )
    p.add_argument("--peers-dir", type=Path, default=None)
    p.add_argument("--no-write-docs", dest="write_docs", action="store_false")
    args = p.parse_args(argv)
    import os

    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.threads = args.threads or os.cpu_count() or 2
    command = shlex.join(["python", "bench/big_model.py", *(sys.argv[1:] if argv is None else argv)])
    gguf_path = write_gguf(args.gguf, args.seed)
    if "wsllm" in args.servers:  # the one-time config/tokenizer conversion and repack: not "ready in"
        warm = ("from wsllm.config import EngineConfig; from wsllm.models.build import build_model; "
                f"build_model(EngineConfig(model={str(gguf_path)!r}, num_kv_blocks=16))")  # fmt: skip
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", warm], check=True)
        print(f"wsllm's config, tokenizer and repack ready (cached after the first run) in "
              f"{time.monotonic() - t:.0f} s", file=sys.stderr)  # fmt: skip
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="big-model-")))
        serving_peers.write_prompts(args, work)
        rows = [measure(name, gguf_path, args, work) for name in args.servers]
    text = section(rows, args, command, gguf_path)
    print(text)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        path.write_text(serving_report.replace_section(path.read_text(), TITLE, text))
        print(f"wrote the '{TITLE}' section of {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
