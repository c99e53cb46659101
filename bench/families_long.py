"""bench/families.py's long-context run: one request of a long prompt (16,000 token ids by default,
the same for both servers) on the Gemma-3 shape, then `--output-len` tokens of decode, greedy.

llama-server runs with `-c <prompt + LONG_SLACK> -np 1 -ub 512` on its native /completion, streamed;
the KV it holds is what its log says it allocated (`llama_kv`: its full layers' cache and its
windowed layers' smaller one, both f16, allocated whole at start). wsllm runs its engine in this
process (`engine_for`: configured as `wsllm serve` with `--wsllm-args` would be) with the same KV
capacity, since no HTTP route publishes EngineStats.kv_bytes_used: the bytes its sequence holds at
its most (a windowed layer's blocks that its window has left go back to the pool) and its pool's
size; beside them, what full attention on every layer would hold at wsllm's KV dtype."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_shapes as fs  # noqa: E402  (sibling scripts, not a package)
import random_gguf  # noqa: E402
import serving_peers  # noqa: E402

LONG_SLACK = 448  # the KV beyond the prompt: the decode and a margin (16,000 -> 16,448)
SMOLLM2_TOKENS = 49152  # the padded tokenizer's own tokens (ids past them are padding)


def long_prompt(n: int, seed: int, vocab: int = SMOLLM2_TOKENS) -> list[int]:
    """`n` token ids below `vocab` (the tokenizer's own, not the padding), the same for a seed."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(100, vocab, size=n)]


def engine_for(path: Path, ctx: int, args: argparse.Namespace, max_num_seqs: int = 1) -> Any:
    """wsllm's engine on the file, configured as `wsllm serve --num-kv-blocks <ctx / 16>` with the
    flags of `--wsllm-args` would be."""
    from wsllm.cli import build_parser
    from wsllm.config import EngineConfig, from_args
    from wsllm.engine.engine import LLMEngine

    argv = ["serve", "--num-kv-blocks", str(-(-ctx // 16)), "--max-num-seqs", str(max_num_seqs)]
    cfg = from_args(EngineConfig, build_parser().parse_args([*argv, *shlex.split(args.wsllm_args)]))
    return LLMEngine.from_config(replace(cfg, model=str(path)))


def timed_request(engine: Any, rid: str, ids: list[int], params: Any) -> dict[str, Any]:
    """One request alone on `engine`: its tokens, each token's arrival time from the start, and the
    KV bytes the engine held at its most (EngineStats.kv_bytes_used after each step)."""
    from wsllm.types import GenerateRequest

    start = time.perf_counter()
    engine.add_request(GenerateRequest(rid, ids, params))
    times: list[float] = []
    tokens: list[int] = []
    held = 0
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                tokens += c.new_token_ids
                times += [time.perf_counter() - start] * len(c.new_token_ids)
        held = max(held, engine.stats().kv_bytes_used)
    return {"tokens": tokens, "times": times, "kv_held": held}


def _decode_tps(times: list[float], n: int | None = None) -> float:
    n = len(times) if n is None else n
    return (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else float("nan")


def long_wsllm(path: Path, s: fs.Gemma3Shape, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """The request on wsllm's engine in this process: TTFT, decode tokens/s, the KV bytes held at
    most and the pool's, and full attention's at the same dtype."""
    from wsllm.types import SamplingParams

    engine = engine_for(path, len(ids) + LONG_SLACK, args)
    # a first short request (other ids: no prefix hit), as a server has served one before it is timed
    timed_request(engine, "warm", long_prompt(64, args.seed + 1, min(s.vocab, SMOLLM2_TOKENS)),
                  SamplingParams(max_tokens=2))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    r = timed_request(engine, "long", ids, params)
    k = engine.cache.kv_caches[0][0]
    pool = engine.stats().kv_bytes_total
    del engine
    return {"name": "wsllm", "prompt_tokens": len(ids), "ttft_s": r["times"][0], "decode_tps": _decode_tps(r["times"]),
            "kv_held": r["kv_held"], "kv_pool": pool, "kv_dtype": str(k.dtype).removeprefix("torch."),
            "kv_full": fs.full_attention_kv_bytes(s, len(ids) + args.output_len, k.element_size())}  # fmt: skip


_LLAMA_KV = re.compile(
    r"creating\s+(non-SWA|SWA) KV cache|llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells"
)


def llama_kv(log: str) -> dict[str, tuple[float, int]]:
    """llama-server's KV caches from its log: {"non-SWA" | "SWA" | "KV": (bytes, cells)}, each
    `llama_kv_cache: size = ...` line under the `creating ... KV cache` line before it."""
    out: dict[str, tuple[float, int]] = {}
    kind = "KV"
    for m in _LLAMA_KV.finditer(log):
        if m.group(1):
            kind = m.group(1)
        else:
            out[kind] = (float(m.group(2)) * 2**20, int(m.group(3)))
    return out


def long_llamacpp(path: Path, ids: list[int], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The request on llama-server's native /completion, streamed: TTFT, decode tokens/s, and the KV
    caches its log says it allocated."""
    port = serving_peers.free_port()
    argv = random_gguf.server_argv(
        "llamacpp", path, port, args, ctx=len(ids) + LONG_SLACK, slots=1, extra=["-ub", "512", "-lv", "4"]
    )
    log = work / "llamacpp-long.log"
    body = {"prompt": ids, "n_predict": args.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}  # fmt: skip
    times: list[float] = []
    last: dict[str, Any] = {}
    with serving_peers.running(random_gguf.server("llamacpp", argv), port, log):
        start = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{port}/completion", json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                last = json.loads(line[6:])
                if last.get("content") or last.get("tokens"):
                    times.append(time.perf_counter() - start)
    kv = llama_kv(log.read_text(errors="replace"))
    timings = last.get("timings") or {}
    n = int(timings.get("predicted_n") or len(times))
    return {"name": "llamacpp", "prompt_tokens": int(timings.get("prompt_n") or len(ids)), "ttft_s": times[0],
            "decode_tps": _decode_tps(times, n), "kv_held": sum(b for b, _ in kv.values()),
            "kv_pool": sum(b for b, _ in kv.values()), "kv_dtype": "f16", "kv_parts": kv}  # fmt: skip


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def long_text(s: fs.Gemma3Shape, rows: list[dict[str, Any]]) -> str:
    """The run's table: each server's KV held and allocated, TTFT and decode speed, and wsllm's
    ratios to llama-server."""
    head = ["server", "prompt tokens", "KV held", "KV allocated", "held / full attention", "TTFT",
            "decode tokens/s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        full = r.get("kv_full")
        parts = ", ".join(f"{k} {_mib(b)} ({c} cells)" for k, (b, c) in r.get("kv_parts", {}).items())
        cells = [r["name"], str(r["prompt_tokens"]), f"{_mib(r['kv_held'])} ({r['kv_dtype']})",
                 _mib(r["kv_pool"]) + (f": {parts}" if parts else ""),
                 f"{r['kv_held'] / full:.2f}x" if full else "", f"{r['ttft_s']:.2f} s", f"{r['decode_tps']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    by = {r["name"]: r for r in rows}
    if {"wsllm", "llamacpp"} <= set(by):
        ws, lc = by["wsllm"], by["llamacpp"]
        cells = ["**wsllm / llama-server**", "", f"**{ws['kv_held'] / lc['kv_held']:.2f}x**", "", "",
                 f"**{ws['ttft_s'] / lc['ttft_s']:.2f}x**", f"**{ws['decode_tps'] / lc['decode_tps']:.2f}x**"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return (
        f"{s.name} ({s.layers} layers), one request at {rows[0]['prompt_tokens']:,} tokens:\n\n"
        + "\n".join(lines)
    )
