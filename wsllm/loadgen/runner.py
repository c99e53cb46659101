"""Drive the load: for each concurrency level, send every prompt (all at once, or
with Poisson arrivals at `--request-rate`), at most `concurrency` in flight, then
report. One warm-up request per level is sent first and not counted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from wsllm.loadgen import BenchConfig, speculation
from wsllm.loadgen.clients import Client, Result, SSEClient, WSClient, auth_headers, root_url
from wsllm.loadgen.prompts import Prompt, from_jsonl, synthetic
from wsllm.loadgen.report import summarize, table

log = logging.getLogger(__name__)


def main(cfg: BenchConfig) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        out = asyncio.run(run_all(cfg))
    except (ValueError, OSError, RuntimeError, httpx.HTTPError) as e:
        print(f"wsllm bench: {e}", file=sys.stderr)
        return 2
    print(describe(cfg, out["model"]))
    print(table(out["runs"]))
    for run in out["runs"]:
        for err in run["errors"]:
            print(f"error (concurrency {run['concurrency']}): {err}", file=sys.stderr)
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {cfg.json}")
    if cfg.plot:
        from wsllm.loadgen.plots import write

        for path in write(
            out["runs"], cfg.plot, f"{out['model'] or 'default model'}, {cfg.transport.upper()}"
        ):
            print(f"wrote {path}")
    return 0 if all(r["completed"] for r in out["runs"]) else 1


def describe(cfg: BenchConfig, model: str | None) -> str:
    source = f"prompts from {cfg.prompts}" if cfg.prompts else f"{cfg.input_len} input tokens"
    rate = f"{cfg.request_rate:g} req/s (Poisson)" if cfg.request_rate else "all at once"
    return (
        f"\nwsllm bench: {model or 'default model'} at {root_url(cfg.base_url)} over {cfg.transport.upper()} "
        f"(/{cfg.endpoint}); {cfg.num_requests} requests per level, {source}, up to {cfg.output_len} "
        f"output tokens, arrivals {rate}\n"
    )


async def run_all(cfg: BenchConfig) -> dict[str, Any]:
    model = cfg.model or await discover_model(cfg)
    if cfg.prompts:
        prompts = from_jsonl(cfg.prompts, cfg.num_requests, cfg.output_len, cfg.tokenizer)
    else:
        prompts = synthetic(cfg.num_requests, cfg.input_len, cfg.output_len, cfg.tokenizer, cfg.seed)
    runs = []
    for level in cfg.levels():
        client = await make_client(cfg, model, level)
        try:
            warm = await client.send(
                dataclasses.replace(prompts[0], max_tokens=min(4, prompts[0].max_tokens))
            )
            if not warm.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
            before = await speculation.counters(cfg.base_url, auth_headers(cfg))
            runs.append(await run_level(cfg, client, prompts, level))
            if before:  # the server's gauges follow its engines' heartbeats: let the last one land
                await asyncio.sleep(speculation.SETTLE_S)
            after = await speculation.counters(cfg.base_url, auth_headers(cfg))
            runs[-1]["speculation"] = speculation.summary(before, after)
        finally:
            await client.close()
    return {
        "config": dataclasses.asdict(dataclasses.replace(cfg, api_key="***" if cfg.api_key else None)),
        "model": model,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": runs,
    }


async def discover_model(cfg: BenchConfig) -> str | None:
    """The first id of /v1/models; None (send no model) when the server lists none."""
    url = root_url(cfg.base_url) + "/v1/models"
    async with httpx.AsyncClient(headers=auth_headers(cfg), timeout=10) as http:
        r = await http.get(url)
    if r.status_code != 200:
        log.warning("GET %s answered %d; sending no model", url, r.status_code)
        return None
    data = r.json().get("data") or []
    return str(data[0]["id"]) if data else None


async def make_client(cfg: BenchConfig, model: str | None, concurrency: int | None) -> Client:
    if cfg.transport == "sse":
        return SSEClient(cfg, model, concurrency)
    ws = WSClient(cfg, model)
    await ws.open(concurrency or 1)
    return ws


async def run_level(
    cfg: BenchConfig, client: Client, prompts: list[Prompt], concurrency: int | None
) -> dict[str, Any]:
    rng = np.random.default_rng(cfg.seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    label = f"concurrency {concurrency}" if concurrency else f"{cfg.request_rate:g} req/s"
    bar = tqdm(total=len(prompts), desc=label, unit="req", file=sys.stderr, leave=True)

    async def one(p: Prompt) -> Result:
        if limit is None:
            r = await client.send(p)
        else:
            async with limit:  # TTFT starts when the request is sent, not while it waits here
                r = await client.send(p)
        bar.update(1)
        return r

    started = time.perf_counter()
    tasks = []
    for i, p in enumerate(prompts):
        if cfg.request_rate and i:
            await asyncio.sleep(rng.exponential(1.0 / cfg.request_rate))
        tasks.append(asyncio.create_task(one(p)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    bar.close()
    return summarize(list(results), started, duration, concurrency, cfg.request_rate)
