"""Offline throughput: wsllm's engine against Hugging Face `generate`, same run.

Both get the same 64 prompts and the same output lengths (fixed seed, 16..256
tokens, EOS ignored). HF runs in left-padded batches, sorted by output length so
that each batch wastes as little as possible, at each batch size given; the best
one is reported. Only the requested tokens count for either side.

    .venv/bin/python bench/offline_throughput.py [--model DIR] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from datetime import date

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOPICS = [
    "the history of the printing press",
    "how rainbows form",
    "a recipe for bread",
    "the rules of chess",
    "why cats purr",
    "the water cycle",
    "how to learn a language",
    "the life of bees",
    "volcanoes",
    "the first computers",
    "a trip to the mountains",
    "how vaccines work",
    "the moon landing",
    "black holes",
    "the Roman empire",
    "photosynthesis",
]


def make_workload(n: int, seed: int, tok) -> tuple[list[list[int]], list[int]]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    prompts, outs = [], []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 6)))
        text = f"Write a short essay about {topic}. Mention {words}." if words else f"Tell me about {topic}."
        msgs = [{"role": "user", "content": text}]
        prompts.append(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        outs.append(rng.randint(16, 256))
    return prompts, outs


def run_wsllm(
    model_dir: str, prompts: list[list[int]], outs: list[int], max_num_seqs: int, dtype: str
) -> float:
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import GenerateRequest, SamplingParams

    engine = LLMEngine.from_config(
        EngineConfig(model=model_dir, max_num_seqs=max_num_seqs, kv_cache_gb=2.0, dtype=dtype)
    )
    # warm-up
    engine.add_request(
        GenerateRequest("w", prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    )
    while engine.has_unfinished():
        engine.step()
    t = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        engine.add_request(
            GenerateRequest(str(i), p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        )
    bar = tqdm(total=sum(outs), desc="wsllm", unit="tok")
    while engine.has_unfinished():
        for r in engine.step():
            bar.update(sum(len(c.new_token_ids) for c in r.outputs))
    bar.close()
    return sum(outs) / (time.perf_counter() - t)


def run_hf(model_dir: str, prompts: list[list[int]], outs: list[int], batch: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    order = sorted(range(len(prompts)), key=lambda i: outs[i])
    pad = 0
    t = time.perf_counter()
    bar = tqdm(total=sum(outs), desc=f"hf b={batch}", unit="tok")
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        new = max(outs[i] for i in idx)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        bar.update(sum(outs[i] for i in idx))
    bar.close()
    return sum(outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir; default the bundled SmolLM2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16, for both sides")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from wsllm.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, outs = make_workload(args.num_requests, args.seed, tok)
    print(f"{len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, output tokens {sum(outs)}")
    ours = run_wsllm(model_dir, prompts, outs, args.max_num_seqs, args.dtype)
    hf = {
        b: run_hf(model_dir, prompts, outs, b, args.dtype) for b in map(int, args.hf_batch_sizes.split(","))
    }
    best_b = max(hf, key=lambda b: hf[b])
    rows = [("wsllm (continuous batching)", ours)] + [(f"HF generate, batch {b}", v) for b, v in hf.items()]
    print("\n| system | output tokens/s |\n| --- | ---: |")
    for name, v in rows:
        print(f"| {name} | {v:.1f} |")
    print(f"\nratio wsllm / best HF (batch {best_b}): {ours / hf[best_b]:.2f}x")
    print(
        f"dtype {args.dtype}; machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {date.today()}"
    )


if __name__ == "__main__":
    main()
