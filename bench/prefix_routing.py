"""Prefix-aware routing against FIFO routing, on the Redis broker, same run.

N engines (threads of this process, each an `EngineWorker` on its own Redis engine
side) of a small random-weight Llama serve C multi-turn chats. Each chat opens with a
long first message (a pasted document) and then sends T - 1 short ones; every turn
resends the whole conversation so far, as chat clients do, and the next turn starts
when the answer ends. Three runs on a fresh redis-server: one engine serving all the
chats (the prefix-cache reference), N engines with `--routing fifo`, N engines with
`--routing prefix`. Each run's chats use fresh random tokens, so no run finds
another's blocks. Reports the prefix-cache hit rate (cached prompt tokens / prompt
tokens, over all engines), TTFT p50 / p90 (gateway submit to the first token event),
and the two ratios the acceptance names: hit rate prefix / one engine (>= 0.9) and
TTFT p50 prefix / fifo (<= 0.7).

    .venv/bin/python bench/prefix_routing.py [--engines 4] [--chats 16] [--turns 4]
    .venv/bin/python bench/prefix_routing.py --write-docs   # and put it in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_overhead import redis_server  # noqa: E402  (bench/ helpers; run as a script)


def make_model(path: Path, hidden: int, layers: int) -> str:
    """A random-weight Llama, big enough that prefill costs more than the broker."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return str(path)


def chats(n: int, turns: int, first: int, later: int, seed: int) -> list[list[list[int]]]:
    """Each chat's user messages (token ids), fresh random tokens per run."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(10, 8000) for _ in range(first if t == 0 else later)] for t in range(turns)]
        for _ in range(n)
    ]


async def drive(gw: Any, convs: list[list[list[int]]], reply: int) -> list[float]:
    """Run every chat turn after turn, all chats at once; TTFT of every request."""
    from wsllm.types import GenerateRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    waiting: dict[str, asyncio.Queue[Any]] = {}
    ttfts: list[float] = []

    async def reader() -> None:
        async for batch in gw.events():
            for ev in batch:
                q = waiting.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)

    async def chat(c: int, messages: list[list[int]]) -> None:
        history: list[int] = []
        for t, msg in enumerate(messages):
            history += msg
            rid = f"c{c}-t{t}-{random.getrandbits(32):08x}"
            q: asyncio.Queue[Any] = asyncio.Queue()
            waiting[rid] = q
            t0 = time.perf_counter()
            await gw.submit(GenerateRequest(rid, list(history), params, model="m", arrival_time=time.time()))
            got: list[int] = []
            while True:
                ev = await q.get()
                if ev.token_ids and not got:
                    ttfts.append(time.perf_counter() - t0)
                got += ev.token_ids
                if ev.finish_reason or ev.ends_request:
                    break
            del waiting[rid]
            history += got

    task = asyncio.create_task(reader())
    await asyncio.gather(*(chat(c, m) for c, m in enumerate(convs)))
    task.cancel()
    return ttfts


def run(url: str, engines: list[Any], routing: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    import redis

    from wsllm.broker.redis import RedisBroker
    from wsllm.config_redis import RedisConfig
    from wsllm.engine.worker import EngineWorker

    redis.Redis.from_url(url).flushall()
    cfg = RedisConfig(routing=routing, steal_after_s=args.steal_ms / 1000)
    sides = [RedisBroker(url, model="m", cfg=cfg, engine_id=f"e{i}") for i in range(len(engines))]
    workers = [
        EngineWorker(e, s, engine_id=f"e{i}") for i, (e, s) in enumerate(zip(engines, sides, strict=True))
    ]
    before = [(e.block_manager.hit_tokens, e.block_manager.queried_tokens) for e in engines]
    for w in workers:
        w.start()
    gw = RedisBroker(url, model="m", cfg=cfg, max_queue_depth=4096)
    try:
        convs = chats(args.chats, args.turns, args.first, args.later, seed)
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(gw, convs, args.reply))
        wall = time.perf_counter() - t0
    finally:
        gw.close()
        for w in workers:
            w.stop()
        for s in sides:
            s.close()
    hits = sum(e.block_manager.hit_tokens - b[0] for e, b in zip(engines, before, strict=True))
    queried = sum(e.block_manager.queried_tokens - b[1] for e, b in zip(engines, before, strict=True))
    ttfts.sort()
    return {
        "hit": hits / max(1, queried),
        "p50": statistics.median(ttfts),
        "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "wall": wall,
    }


def report(res: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    rows = [
        "| run | engines | prefix-cache hit rate | TTFT p50 | TTFT p90 | wall |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res.items():
        n = 1 if name == "one engine" else args.engines
        rows.append(
            f"| {name} | {n} | {r['hit']:.3f} | {r['p50'] * 1000:.1f} ms | {r['p90'] * 1000:.1f} ms | {r['wall']:.2f} s |"
        )
    hit_ratio = res["prefix"]["hit"] / max(1e-9, res["one engine"]["hit"])
    ttft_ratio = res["prefix"]["p50"] / res["fifo"]["p50"]
    return (
        "\n".join(rows)
        + f"\n\nHit rate prefix / one engine: **{hit_ratio:.2f}** (target >= 0.9); TTFT p50 prefix / fifo: "
        f"**{ttft_ratio:.2f}** (target <= 0.7). {args.chats} chats x {args.turns} turns (first message "
        f"{args.first} tokens, then {args.later}; answers {args.reply} tokens), all chats at once; "
        + (args.model or f"a random Llama of hidden size {args.hidden}, {args.layers} layers")
        + f", float32 on the CPU; {args.engines} engines as threads of one process on one "
        f"redis-server; steal delay {args.steal_ms} ms."
    )


def write_docs(text: str, command: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    flags = subprocess.run(["grep", "-m1", "flags", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    section = (
        "## Prefix-aware routing\n\n"
        f"`{command}` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}).\n\n{text}\n\nCPU (`grep -m1 flags /proc/cpuinfo`):\n\n```\n{flags.strip()}\n```\n"
    )
    old = path.read_text()
    pattern = re.compile(r"^## Prefix-aware routing\n.*?(?=^## |\Z)", re.S | re.M)
    new = (
        pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    )
    path.write_text(new.rstrip() + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=768, help="tokens of each chat's first message")
    p.add_argument("--later", type=int, default=48, help="tokens of each later message")
    p.add_argument("--reply", type=int, default=16, help="tokens of each answer")
    p.add_argument("--hidden", type=int, default=512, help="the random model's hidden size")
    p.add_argument("--layers", type=int, default=4, help="the random model's layers")
    p.add_argument("--model", default=None, help="a model directory instead (e.g. SmolLM2 with --engines 2)")
    p.add_argument("--steal-ms", type=float, default=50.0)
    p.add_argument("--redis-url", default=None, help="an existing Redis (flushed!); default: start one")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    args = p.parse_args()

    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp), args.hidden, args.layers)
        cfg = EngineConfig(model=model, num_kv_blocks=2048, max_num_seqs=16, dtype="float32")
        engines = [LLMEngine.from_config(cfg) for _ in range(args.engines)]
        with redis_server(args.redis_url) as url:
            res = {
                "one engine": run(url, engines[:1], "fifo", args, seed=1),
                "fifo": run(url, engines, "fifo", args, seed=2),
                "prefix": run(url, engines, "prefix", args, seed=3),
            }
    text = report(res, args)
    print(text)
    if args.write_docs:
        flags = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        write_docs(text, f"python bench/prefix_routing.py {flags}".strip())


if __name__ == "__main__":
    main()
