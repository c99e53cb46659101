"""What structured output costs: the engine's throughput with a JSON-schema constraint on
every request against the same requests unconstrained, same run.

SmolLM2 (fp32 unless --dtype), `--concurrency` chat prompts at once, greedy, each run
to `--max-tokens` output tokens: the constrained ones answer a schema whose one string
must be longer than that, so neither side stops early and both produce the same number
of tokens. Runs alternate between the two (and repeat), so both see the same machine.
The cost measured is llguidance's mask for every row of every step and its matcher
advance, on the engine's thread (the sampler fills the rows' masks in parallel).

    .venv/bin/python bench/structured_overhead.py [--concurrency 32] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time
from datetime import date
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "answer": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "answer"],
    "additionalProperties": False,
}
TOPICS = ["rainbows", "bread", "chess", "cats", "tides", "volcanoes", "bees", "glass"]


def run(engine: Any, prompts: list[list[int]], structured: bool, max_tokens: int) -> tuple[float, int]:
    from wsllm.types import GenerateRequest, SamplingParams

    spec = {"json": SCHEMA} if structured else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)
    for i, p in enumerate(prompts):
        engine.add_request(
            GenerateRequest(f"{'s' if structured else 'p'}{time.monotonic_ns()}-{i}", p, params)
        )
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert o.error is None, o.error
                tokens += len(o.outputs[0].token_ids)
    return time.perf_counter() - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the bundled SmolLM2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(args.concurrency))
    )
    tok = AutoTokenizer.from_pretrained(engine.model_dir)

    def prompt(i: int) -> list[int]:
        msg = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (#{i}), as JSON."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False).input_ids)

    run(engine, [prompt(0)] * 2, True, 8)  # warm up: the tokenizer index, the first compile
    rows = [
        "| concurrency | unconstrained tok/s | JSON schema tok/s | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for c in args.concurrency:
        prompts = [prompt(i) for i in range(c)]
        got: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for structured in (False, True):
                secs, n = run(engine, prompts, structured, args.max_tokens)
                assert n == c * args.max_tokens, (n, c * args.max_tokens)
                got[structured].append(n / secs)
        plain, constrained = (max(got[k]) for k in (False, True))
        rows.append(f"| {c} | {plain:.1f} | {constrained:.1f} | {constrained / plain:.2f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.write_docs:
        cpuinfo = Path("/proc/cpuinfo")
        flags = cpuinfo.read_text() if cpuinfo.exists() else ""
        m = re.search(r"^flags\s*:\s*(.*)$", flags, re.M)
        has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if m and f in m.group(1).split()]
        section = (
            "## Structured output overhead\n\n"
            f"`python bench/structured_overhead.py` ({date.today()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {', '.join(has)}; {args.dtype}, greedy, {args.max_tokens} output tokens "
            f"each, best of {args.repeat} runs alternating).\n\n{table}\n\n"
            "JSON schema: an object with a bounded title and an answer string of at least 2000 characters, so "
            "that every constrained answer runs to max_tokens as the unconstrained ones do.\n"
        )
        path = ROOT / "docs" / "benchmarks.md"
        old = path.read_text()
        pattern = re.compile(r"^## Structured output overhead\n.*?(?=^## |\Z)", re.S | re.M)
        new = (
            pattern.sub(lambda _: section + "\n", old)
            if pattern.search(old)
            else old.rstrip() + "\n\n" + section
        )
        path.write_text(new.rstrip() + "\n")


if __name__ == "__main__":
    main()
