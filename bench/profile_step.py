"""Where a decode step's time goes, at a few batch sizes.

For each batch size B: B chat prompts are prefilled, then `--steps` decode steps are
timed twice: once by phase (scheduler, input preparation, model forward, logits,
sampler, postprocess, and the worker's event building and publishing), once under
torch.profiler grouped by op kind (matmuls, attention, elementwise, ...). Beside it,
the same run times a loop of plain `F.linear` calls over the model's weight shapes at
batch B: the "matmul limit" the step is compared with.

    .venv/bin/python bench/profile_step.py --batch-sizes 1,32 [--steps 20] [--dtype float32]
    .venv/bin/python bench/profile_step.py --dtype auto --batch-sizes 1 --fused both   # A/B, same run

On a shared machine wall time mostly measures the neighbours: `--clock cpu --engine-arg
threads=1` times by this thread's CPU time instead (the step runs on this thread alone).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = [  # first match wins; op names as torch.profiler reports them
    ("matmul", ("addmm", "aten::mm", "aten::linear", "matmul", "aten::bmm", "mkl", "mkldnn", "onednn")),
    ("attention", ("scaled_dot_product", "attention", "_flash", "softmax")),
    ("kv gather/store", ("index_select", "index_put", "index_copy", "gather", "scatter")),
    ("sampling", ("argmax", "sort", "topk", "exponential", "multinomial", "cumsum")),
    ("copies/views", ("copy_", "aten::to", "contiguous", "clone", "cat", "stack", "_to_copy")),
    ("elementwise", ("mul", "add", "sub", "div", "rsqrt", "pow", "mean", "silu", "neg", "where", "exp")),
    ("tensor creation", ("aten::tensor", "empty", "zeros", "full", "arange", "ones", "from_")),
]


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


CLOCK: Callable[[], float] = time.perf_counter  # --clock cpu: time.thread_time


class PhaseTimer:
    """Wraps bound methods so each call adds its time (CLOCK) to a phase."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            if not self.enabled:
                return fn(*a, **k)
            t = CLOCK()
            try:
                return fn(*a, **k)
            finally:
                self.total[phase] += CLOCK() - t

        setattr(obj, attr, timed)


def build_worker(model: str | None, dtype: str, batch: int, extra: dict[str, Any]) -> Any:
    from wsllm.broker.memory import MemoryBroker
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker

    engine = LLMEngine.from_config(
        EngineConfig(model=model, dtype=dtype, max_num_seqs=max(batch, 1), **extra)
    )
    return EngineWorker(engine, MemoryBroker(max_event_batches=1 << 20))


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    topics = ["rainbows", "bread", "chess", "bees", "volcanoes", "the moon", "black holes", "Rome"]
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell me about {topics[i % len(topics)]} in a few sentences."}]
        out.append(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    return out


def linear_limit(model: Any, batch: int, steps: int) -> float | None:
    """Seconds per step of plain F.linear over the model's weight shapes at `batch` rows; None
    where those weights in the model's float dtype would take more than a quarter of the
    machine's memory (an 8B model's fp32 copy is 32 GB)."""
    shapes = [
        (m.out_features, m.in_features)
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
    ]
    dtype = model.norm.weight.dtype  # the embedding may be quantized (no .weight)
    need = sum(o * i for o, i in shapes) * torch.tensor([], dtype=dtype).element_size()
    if need > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4:
        return None
    ws = [torch.randn(o, i, dtype=dtype) * 0.02 for o, i in shapes]
    x = {i: torch.randn(batch, i, dtype=dtype) for _, i in shapes}
    with torch.inference_mode():
        for w in ws:
            F.linear(x[w.shape[1]], w)
        t = CLOCK()
        for _ in range(steps):
            for w in ws:
                F.linear(x[w.shape[1]], w)
    return (CLOCK() - t) / steps


def profile_batch(args: argparse.Namespace, batch: int, extra: dict[str, Any], fused: bool) -> dict[str, Any]:
    from wsllm.types import GenerateRequest, SamplingParams

    worker = build_worker(args.model, args.dtype, batch, extra)
    engine = worker.engine
    engine.runner.model.fused_decode = fused  # the native decode stack (quantized weights)
    prompts = chat_prompts(engine.model_dir, batch)
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 64, ignore_eos=True)
    for i, p in enumerate(prompts):
        worker.broker._pending.push(GenerateRequest(f"r{i}", p, params))
    while engine.stats().num_running < batch or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        worker.run_once()
    for _ in range(3):  # warm the decode path
        worker.run_once()
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "scheduler")
    timer.wrap(engine.runner, "_prepare", "input preparation")
    timer.wrap(engine.runner.model, "forward", "model forward")
    timer.wrap(engine.runner.model, "compute_logits", "logits (lm_head)")
    for phase in ("prepare", "draw", "read"):  # the token stage's three phases
        timer.wrap(engine.runner.sampler, phase, "sampler")
    timer.wrap(engine.scheduler, "update_from_output", "postprocess")
    timer.wrap(engine, "_collect", "postprocess")
    timer.wrap(engine, "step", "engine.step")
    timer.wrap(worker.broker, "publish", "publish")
    timer.wrap(worker, "run_once", "worker iteration")
    from wsllm.kernels import quant

    timer.wrap(quant, "qlinear", "quantized matmuls")  # QuantLinear calls it through the module
    timer.enabled = True
    t = CLOCK()
    for _ in range(args.steps):
        worker.run_once()
    wall = (CLOCK() - t) / args.steps
    timer.enabled = False
    phases = {k: v / args.steps for k, v in timer.total.items()}
    kinds: dict[str, float] = defaultdict(float)
    calls = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            worker.run_once()
    for ev in prof.key_averages():
        if ev.key.startswith("aten::") or "mkl" in ev.key or "onednn" in ev.key:
            kinds[kind_of(ev.key)] += ev.self_cpu_time_total / 1e6 / args.profile_steps
        if ev.key.startswith("aten::"):
            calls += ev.count
    limit = linear_limit(engine.runner.model, batch, args.steps)
    layers = engine.runner.model.config.num_layers
    qbytes = sum(m.qweight.nbytes() for m in engine.runner.model.modules() if hasattr(m, "forward_float"))
    return {
        "batch": batch, "wall": wall, "phases": phases, "kinds": dict(kinds), "limit": limit,
        "aten_calls": calls / args.profile_steps, "layers": layers, "fused": fused, "qbytes": qbytes,
    }  # fmt: skip


def report(r: dict[str, Any]) -> str:
    b, wall = r["batch"], r["wall"]
    p = r["phases"]
    step = p.get("engine.step", 0.0)
    fwd = p.get("model forward", 0.0) + p.get("logits (lm_head)", 0.0)
    lines = [
        f"### batch {b}{'' if r['fused'] else ' (--fused off)'}: {wall * 1e3:.1f} ms per worker iteration "
        f"= {b / wall:.1f} tokens/s "
        + (
            f"(F.linear over the weights: {r['limit'] * 1e3:.1f} ms = {b / r['limit']:.1f} tokens/s)"
            if r["limit"]
            else "(F.linear over the weights: not run, too large for this machine's memory)"
        ),
        "",
        "| phase | ms per step | share |",
        "| --- | ---: | ---: |",
    ]
    order = ["scheduler", "input preparation", "model forward", "logits (lm_head)", "sampler", "postprocess"]
    for name in order:
        v = p.get(name, 0.0)
        lines.append(f"| {name} | {v * 1e3:.2f} | {v / wall:.0%} |")
    other_step = step - sum(p.get(n, 0.0) for n in order)
    lines.append(f"| rest of engine.step | {other_step * 1e3:.2f} | {other_step / wall:.0%} |")
    pub = p.get("publish", 0.0)
    lines.append(f"| publish | {pub * 1e3:.2f} | {pub / wall:.0%} |")
    worker_rest = wall - step - pub
    lines.append(f"| rest of the worker iteration | {worker_rest * 1e3:.2f} | {worker_rest / wall:.0%} |")
    lines += ["", "| op kind (torch.profiler, self CPU time) | ms per step |", "| --- | ---: |"]
    for kind, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {v * 1e3:.2f} |")
    qmm = p.get("quantized matmuls", 0.0)
    if qmm:
        lines.append(f"| quantized matmuls (ours, not seen by the profiler) | {qmm * 1e3:.2f} |")
    if r["qbytes"]:
        lines.append(
            f"\nQuantized weights read per step: {r['qbytes'] / 1e6:.1f} MB, {r['qbytes'] / wall / 1e9:.2f} GB/s "
            "at this step time (a decode step over the native stack runs its layers' matmuls inside "
            "'model forward', not 'quantized matmuls')."
        )
    lines.append(f"\nModel forward + logits: {fwd * 1e3:.1f} ms of {wall * 1e3:.1f} ms ({fwd / wall:.0%}).")
    lines.append(
        f"aten ops dispatched per step: {r['aten_calls']:.0f} ({r['aten_calls'] / r['layers']:.1f} per layer, nested included)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--engine-arg", action="append", default=[], help="key=value for EngineConfig")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: this thread's CPU time")
    ap.add_argument(
        "--fused",
        choices=["on", "off", "both"],
        default="on",
        help="decode layers over quantized weights in one native call (on), layer by layer (off), or both in turn",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    extra: dict[str, Any] = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        extra[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.fused]
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for fused in modes:
            print(report(profile_batch(args, b, extra, fused)), flush=True)


if __name__ == "__main__":
    main()
