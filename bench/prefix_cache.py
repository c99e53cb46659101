"""Prefix caching on a multi-turn chat workload, caching on against off, same run.

Each of C conversations has a shared system prompt and T turns; every turn resends
the whole conversation so far (as chat clients do) and generates a fixed number of
tokens. All conversations' turn t run together; turn t+1 starts when they end.
Reports output tokens/s, mean and p90 time to first token, and the hit rate.

    .venv/bin/python bench/prefix_cache.py [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import date

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = (
    "You are a helpful assistant for a hardware store. You answer questions about tools, "
    "materials and home repairs. Be precise, friendly and brief. If a question is unsafe, "
    "explain the risk and suggest calling a professional. Always mention the aisle number "
    "when you name a product, and never invent prices. "
) * 4
QUESTIONS = [
    "Which drill bit should I use for concrete?",
    "How do I fix a leaking tap?",
    "What glue works on plastic?",
    "How do I hang a heavy mirror?",
    "Which paint suits a bathroom?",
    "How do I unclog a drain?",
    "What saw cuts metal pipes?",
    "How do I patch a hole in drywall?",
]


def run(model_dir: str, caching: bool, convs: int, turns: int, out_len: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = LLMEngine.from_config(
        EngineConfig(model=model_dir, enable_prefix_caching=caching, kv_cache_gb=2.0, max_num_seqs=64)
    )
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    history = [[{"role": "system", "content": SYSTEM}] for _ in range(convs)]
    ttfts: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        starts: dict[str, float] = {}
        for c in range(convs):
            history[c].append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            ids = tok.apply_chat_template(
                history[c], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            rid = f"{turn}-{c}"
            starts[rid] = time.perf_counter()
            engine.add_request(GenerateRequest(rid, ids, params))
        answers: dict[str, list[int]] = {}
        seen: set[str] = set()
        while engine.has_unfinished():
            for o in engine.step():
                now = time.perf_counter()
                if o.request_id not in seen and o.outputs[0].new_token_ids:
                    seen.add(o.request_id)
                    ttfts.append(now - starts[o.request_id])
                if o.finished:
                    answers[o.request_id] = o.outputs[0].token_ids
                    tokens += len(o.outputs[0].token_ids)
        for c in range(convs):
            text = tok.decode(answers[f"{turn}-{c}"], skip_special_tokens=True)
            history[c].append({"role": "assistant", "content": text})
    elapsed = time.perf_counter() - t0
    ttfts.sort()
    return {
        "tok_s": tokens / elapsed,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit_rate": engine.stats().prefix_hit_rate,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    from wsllm.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    off = run(model_dir, False, args.conversations, args.turns, args.output_len)
    on = run(model_dir, True, args.conversations, args.turns, args.output_len)
    print("\n| prefix caching | output tokens/s | TTFT mean (ms) | TTFT p90 (ms) | hit rate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in (("off", off), ("on", on)):
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['ttft_mean'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} "
            f"| {r['hit_rate']:.0%} |"
        )
    print(
        f"\nthroughput on/off: {on['tok_s'] / off['tok_s']:.2f}x; "
        f"mean TTFT off/on: {off['ttft_mean'] / on['ttft_mean']:.2f}x"
    )
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {date.today()}")


if __name__ == "__main__":
    main()
