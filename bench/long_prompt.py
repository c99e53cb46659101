"""A lone long prompt, and the same prompt arriving beside decoding streams (issue 44,
acceptance 5): how long the engine's steps get while it prefills, its time to first token, and
the decoding streams' longest gap between two tokens.

In process, on `LLMEngine` (the bundled SmolLM2 unless `--model`), no gateway: two phases,
alternating over `--repeat` runs, the best run of each figure counts.

- `alone`: one prompt of `--prompt-len` random token ids, nothing else running: every step's
  wall time until its first token (the longest, the sum) and its TTFT;
- `beside`: `--streams` short greedy streams decode, then the same long prompt arrives: the
  streams' longest gap between two tokens while it prefills, the longest step, its TTFT.

The same script runs on a checkout whose `add_request` still takes loose arguments, so that
before and after are measured by one program:

    .venv/bin/python bench/long_prompt.py                       # in each checkout, alternating
    .venv/bin/python bench/long_prompt.py --engine-arg prefill_ms_alone=0   # no time bound alone

It prints; it never asserts.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Phase:
    steps_s: list[float] = field(default_factory=list)  # the steps until the long prompt's first token
    ttft_s: float = 0.0
    gap_s: float = 0.0  # the streams' longest gap between two tokens while it prefilled


def add(engine: Any, rid: str, ids: list[int], params: Any) -> None:
    """`add_request` of either signature: one GenerateRequest, or the loose arguments of before."""
    if list(inspect.signature(engine.add_request).parameters) == ["request"]:
        from wsllm.types import GenerateRequest

        engine.add_request(GenerateRequest(rid, ids, params))
    else:
        engine.add_request(rid, ids, params)


def long_prompt(engine: Any, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, engine.vocab_size - 1000) for _ in range(n)]


def run_phase(engine: Any, args: argparse.Namespace, streams: int, run: int) -> Phase:
    from wsllm.types import SamplingParams

    most = min(2000, engine.max_model_len - 64)  # they decode until the long prompt's first token
    greedy = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
    rng = random.Random(run)
    for i in range(streams):
        add(engine, f"s{run}-{i}", [rng.randrange(1000, 20000) for _ in range(64)], greedy)
    last: dict[str, float] = {}
    for _ in range(8 if streams else 0):  # the streams prefilled and decoding
        for o in engine.step():
            last[o.request_id] = time.perf_counter()
    phase = Phase()
    rid = f"long{run}"
    started = time.perf_counter()
    add(engine, rid, long_prompt(engine, args.prompt_len, run), SamplingParams(temperature=0.0, max_tokens=2))
    while not phase.ttft_s:
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        phase.steps_s.append(now - t)
        for o in outs:
            if o.request_id == rid and any(c.new_token_ids for c in o.outputs):
                phase.ttft_s = now - started
            elif o.request_id in last:
                phase.gap_s = max(phase.gap_s, now - last[o.request_id])
                last[o.request_id] = now
    for r in [rid, *last]:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return phase


def best(phases: list[Phase]) -> dict[str, float]:
    return {
        "longest step s": min(max(p.steps_s) for p in phases),
        "steps": min(len(p.steps_s) for p in phases),
        "ttft s": min(p.ttft_s for p in phases),
        "longest gap s": min(p.gap_s for p in phases),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2)")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--streams", type=int, default=16, help="streams decoding beside it")
    p.add_argument("--repeat", type=int, default=2, help="runs of each phase, alternating")
    p.add_argument("--engine-arg", action="append", default=[], help="key=value for EngineConfig")
    args = p.parse_args(argv)
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    extra: dict[str, Any] = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        extra[k] = {"true": True, "false": False}.get(v.lower(), float(v) if v[:1].isdigit() else v)
        if isinstance(extra[k], float) and extra[k].is_integer() and "." not in v:
            extra[k] = int(extra[k])
    engine = LLMEngine.from_config(EngineConfig(model=args.model, max_num_seqs=args.streams + 1, **extra))
    got: dict[str, list[Phase]] = {"alone": [], "beside": []}
    for run in range(args.repeat):
        got["alone"].append(run_phase(engine, args, 0, 2 * run))
        got["beside"].append(run_phase(engine, args, args.streams, 2 * run + 1))
    print(f"{args.prompt_len}-token prompt, {args.streams} streams beside it, best of {args.repeat}")
    for name, phases in got.items():
        print(
            name,
            ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in best(phases).items()
            ),
        )


if __name__ == "__main__":
    main()
