"""Can one tenant's cheap requests make the gateway or the engine do so much work that
everyone else's streams stall? (issue 23, acceptance 3)

One server in its own process (a real engine on a worker thread and the gateway, joined
by the in-process broker, as `wsllm serve`), with a keys file of three tenants:
`bystander`, `attacker` (limits high enough never to refuse) and `refused` (an rpm of 1,
so nearly all its requests are 429s). The engine prefills long prompts in chunks of
`--batched-tokens`, so that a step's length is bounded whoever sends them. 16 bystander
streams (greedy, `ignore_eos`, fixed length) run twice: alone, then while the attacker (a
client process of its own, as another user would be) sends 200 requests, a few at a time,
each trying one amplification:

- `prompt_logprobs`: a ~1,500-token prompt with `prompt_logprobs: 20`, streamed, 40
  output tokens forced to a special token by `logit_bias` with `logprobs` (the issue's
  84 MB reproduction);
- `schema`: a chat request whose `response_format` is a JSON schema never seen before
  (nothing cached: every one compiles);
- `tokenize`: a prompt of most of `--max-body-bytes` to `/tokenize`;
- `refused`: a long prompt with a unique schema from the rate-limited tenant (work done
  before the 429 is work no limit covers).

Before the phases the server gets two short streams and one structured request: a server's
first structured request builds llguidance's index of the tokenizer (once in its life, 1-3 s
holding the GIL: docs/protocol.md), a start-up cost no tenant can repeat, so not measured here.
For each phase it reports the bystanders' worst and p99 gap between two chunks (after
their first token) and their tokens/s, and the ratio of the attacked phase to the quiet
one; the issue's bar is a worst gap less than 2x. Phases alternate over `--repeat` runs
so both see the same background load; the best run of each counts. It prints; it never
asserts.

What the profile showed (issue 23, on the shared 2-core machine, so CPU time rather than
wall time: `--trace FILE` writes each engine step's wall and CPU ms, its tokens and its
prompt-logprob rows, and every event-loop stall over 20 ms):

- CPU per attempt in the server (one torch thread): prompt_logprobs 4.7 s (a 1,700-token
  prefill, whose 512-token chunks cost 0.6 to 1.1 s as the context grows, plus about a third
  for the rows' lm_head, log_softmax and top-k, plus 40 decodes), /tokenize of 900k
  characters 0.95 s, a refused request 0.8 s on average (one in four is admitted and
  prefills; a 429 itself costs nothing measurable), a unique schema 0.14 s.
- The largest stall is not any one request's work but the cores: the engine steps on a
  team of torch threads that wait for each other at every operator, and any other
  runnable thread (the event loop, tokenizations side by side on the default executor,
  the attacking client) makes a step wait for a descheduled member. On a busy 2-core
  machine, 16 decodes took 19 ms at the median and 1.2 s at worst with 2 torch threads,
  60 ms at worst with 1; in a traced attacked run, steps of two decode tokens took 2 s.
- Fixes: prompt-logprob rows count against the step budget (`--prompt-logprob-cost`,
  chunks of ~250 tokens instead of 512 beside 16 decodes) and against the tenant's tpm;
  a request's heavy text work (long tokenizations, large bodies, the prompt table)
  queues on `--text-work-threads` (1) thread at `--text-work-nice` (10), so the engine's
  threads take the cores first; the client makes every body before its phase.
- Step CPU (one torch thread) beside 16 decodes (28 ms alone), for a 1,600-token prompt:
  chunks of 512 cost 660, 870, 1,130 ms as the context grows (plus a third with prompt
  logprobs before this fix); chunks of 256 cost 290 to 540 ms; of 128, 130 to 290 ms. A
  plain long prompt's chunk, paid-for work, is now the longest step: at context 1,500 a
  token costs 2.6x what it costs at 0 (the CPU attention), so the 2x bar on 2 cores
  needs `--batched-tokens` near 256 or a faster attention, not a smaller charge.
- A prompt-logprob row is not the outlier the traces suggested: per row 0.8-1.2 ms of CPU
  (one thread; the LM head's row is 0.65-0.9 of it) against 2.5-4.5 ms for the row's own
  prompt token, so the charge of 1.0 is about 3x the cost (scheduler docstring). What
  stretches steps is the GIL: every operator of a step hands it back and then waits up to
  the switch interval (5 ms) for it, so any thread of the server running Python (or native
  code that keeps the GIL) stalls the engine far beyond its own CPU. One thread doing one
  job in a loop beside 16 decodes (one torch thread, step wall median, 108 ms alone):
  rendering a 1,500 x 20 prompt table (0.1 s of Python) 539 ms; `wire.encode` of that table
  (a Redis publish, on the step thread itself: `asdict` deep-copies it, 0.13-0.25 s, where a
  shallow dict gives the same bytes in 3 ms) 487; `wire.decode` of it (pydantic keeps the
  GIL for its 0.1 s) 5,026; compiling a unique 40-field schema 355; /tokenize of 900k
  characters (`encode_batch`) 364. With `sys.setswitchinterval(0.0005)` (this script's
  `--switch-interval-ms 0.5`): 345, 326, 5,174, 332 and 289 against 131 alone.
- Not changed here: the engine's torch threads. Where the gateway shares the engine's
  cores (`wsllm serve` on 2 cores), `--threads` one less than the cores trades some
  throughput for steady steps; compare `--threads 1` with the default on a quiet machine.

    python bench/amplification.py                    # SmolLM2, print the table
    python bench/amplification.py --smoke            # a few requests, to check it runs
    python bench/amplification.py --redis            # gateway and engine in two processes, over Redis
    python bench/amplification.py --write-docs       # and put the table in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"bystander": "sk-bystander", "attacker": "sk-attacker", "refused": "sk-refused"}
KINDS = ("prompt_logprobs", "schema", "tokenize", "refused")
FOX = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "


def keys_file() -> str:
    limits = {
        "bystander": (10**6, 10**10, 1000),
        "attacker": (10**6, 10**10, 1000),
        "refused": (1, 10**10, 1000),
    }
    text = "".join(
        f'[tenants.{name}]\nkeys = ["{KEYS[name]}"]\nrpm = {rpm}\ntpm = {tpm}\nmax_concurrent = {conc}\n'
        'models = ["*"]\n\n'
        for name, (rpm, tpm, conc) in limits.items()
    )
    path = Path(tempfile.mkdtemp()) / "keys.toml"
    path.write_text(text)
    return str(path)


# -- server side --------------------------------------------------------------------------------


def trace_server(engine: Any, path: str) -> Any:
    """Write one line per engine step (wall start, wall and CPU ms, tokens, prompt-logprob
    rows, decodes, running and waiting requests after it, sequences it preempted, free KV
    blocks), one per event-loop stall over 20 ms and one per garbage collection over 5 ms
    (start, ms, generation, objects freed) to `path`; returns the loop monitor to
    start inside the server's loop. For finding where a bystander's worst gap went."""
    import threading

    out = open(path, "w", buffering=1)  # noqa: SIM115 - lives as long as the server
    lock = threading.Lock()
    step, schedule = engine.step, engine.scheduler.schedule
    last: dict[str, Any] = {}

    def traced_schedule() -> Any:
        got = schedule()
        last["tokens"] = got.num_tokens
        last["plp"] = sum(n for q, n in got.scheduled if q.params.prompt_logprobs is not None)
        last["decodes"] = got.num_decodes
        last["preempted"] = len(got.preempted)
        return got

    def traced_step() -> Any:
        last.clear()
        t, c = time.time(), time.thread_time()
        got = step()
        wall, cpu = (time.time() - t) * 1000, (time.thread_time() - c) * 1000
        with lock:
            st = engine.stats()
            out.write(f"step {t:.3f} {wall:.1f} {cpu:.1f} {last.get('tokens', 0)} {last.get('plp', 0)} "
                      f"{last.get('decodes', 0)} {st.num_running} {st.num_waiting} {last.get('preempted', 0)} "
                      f"{st.num_free_blocks}\n")  # fmt: skip
        return got

    engine.step, engine.scheduler.schedule = traced_step, traced_schedule
    import gc

    gc_start: dict[str, float] = {}

    def gc_pause(phase: str, info: dict[str, Any]) -> None:  # a collection stops every thread
        if phase == "start":
            gc_start["t"] = time.time()
        elif (ms := (time.time() - gc_start.get("t", time.time())) * 1000) > 5:
            with lock:
                out.write(f"gc {gc_start['t']:.3f} {ms:.1f} {info['generation']} {info['collected']}\n")

    gc.callbacks.append(gc_pause)

    async def monitor() -> None:
        while True:
            t = time.time()
            await asyncio.sleep(0.01)
            lag = (time.time() - t - 0.01) * 1000
            if lag > 20:
                with lock:
                    out.write(f"loop {t:.3f} {lag:.1f}\n")

    return monitor


def serve(
    port: int,
    model: str | None,
    threads: int | None,
    batched_tokens: int,
    trace: str | None,
    switch_interval_ms: float | None = None,
    prefill_ms: float | None = None,
) -> None:
    import uvicorn

    from wsllm.broker.memory import MemoryBroker
    from wsllm.config import EngineConfig
    from wsllm.config_gateway import GatewayConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker
    from wsllm.server.app import create_app, uvicorn_config

    broker = MemoryBroker(max_queue_depth=4096)
    # the engine loads on the thread that runs it, as in `wsllm serve` (EngineWorker.spawn)
    worker = EngineWorker.spawn(
        lambda: LLMEngine.from_config(
            EngineConfig(
                model=model,
                threads=threads,
                max_num_seqs=64,
                max_num_batched_tokens=batched_tokens,
                # how long a GIL-holding gateway thread may keep a step waiting (the engine's setting)
                **({} if switch_interval_ms is None else {"gil_switch_ms": switch_interval_ms}),
                **({} if prefill_ms is None else {"prefill_ms_while_decoding": prefill_ms}),
            )  # fmt: skip
        ),
        broker,
    )
    engine: Any = worker.engine
    engine.matchers.warm()
    cfg = GatewayConfig(
        host="127.0.0.1", port=port, max_queue_depth=4096, frontend=False, api_keys_file=keys_file()
    )
    app = create_app(cfg, broker, engine.model_dir, engine.model_name)
    server = uvicorn.Server(uvicorn_config(app, cfg, log_level="warning"))
    if trace is None:
        return server.run()

    async def traced() -> None:
        task = asyncio.create_task(trace_server(engine, trace)())
        await server.serve()
        task.cancel()

    asyncio.run(traced())


def start(args: argparse.Namespace) -> tuple[int, list[subprocess.Popen[bytes]]]:
    """The server's port and its processes (with --redis, the redis-server last)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs: list[subprocess.Popen[bytes]] = []
    if args.redis:  # `wsllm serve --broker redis://`: the gateway here, the engine in a child process
        redis_port = free_port()
        procs.append(
            subprocess.Popen(
                ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
            )
        )
        env["WSLLM_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
        cmd = [sys.executable, "-m", "wsllm", "serve", "--log-level", "warning", "--port", str(port),
               "--no-frontend", "--max-num-seqs", "64", "--max-num-batched-tokens", str(args.batched_tokens),
               "--max-queue-depth", "4096", "--api-keys-file", keys_file()]  # fmt: skip
    else:
        cmd = [sys.executable, __file__, "--serve", "--port", str(port)]
        cmd += ["--batched-tokens", str(args.batched_tokens)]
        cmd += ["--trace", args.trace] if args.trace else []
        cmd += ["--switch-interval-ms", str(args.switch_interval_ms)] if args.switch_interval_ms else []
        cmd += ["--prefill-ms", str(args.prefill_ms)] if args.prefill_ms is not None else []
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    procs.insert(0, proc)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            auth = {"authorization": f"Bearer {KEYS['bystander']}"}
            if httpx.get(f"http://127.0.0.1:{port}/ready", headers=auth, timeout=1).status_code == 200:
                return port, procs
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    for p in procs:
        p.kill()
    raise RuntimeError("the server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- client side --------------------------------------------------------------------------------


@dataclass
class Phase:
    gaps_ms: list[float] = field(default_factory=list)  # between a bystander's chunks, after its first
    gap_at: list[float] = field(default_factory=list)  # wall clock at the end of each gap (--trace)
    tokens: int = 0
    seconds: float = 0.0
    attacks: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, status) -> count
    attack_bytes: int = 0

    @property
    def worst_ms(self) -> float:
        return max(self.gaps_ms, default=float("nan"))

    @property
    def p99_ms(self) -> float:
        s = sorted(self.gaps_ms)
        return s[min(len(s) - 1, int(0.99 * len(s)))] if s else float("nan")


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


async def bystander(http: httpx.AsyncClient, i: int, n_tokens: int, out: Phase) -> None:
    # `logprobs: 0`: a chunk for every token. Without it a token whose text is empty sends none (the
    # model, past its <|im_end|> by `ignore_eos`, writes <|im_end|><|im_start|>: 3 steps in one gap,
    # the worst gap of both phases), and a gap is then not between two tokens
    body = {"prompt": f"Story {i}: {FOX}", "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    last: float | None = None
    async with http.stream("POST", "/v1/completions", json=body, headers=auth("bystander")) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                out.tokens += chunk["usage"]["completion_tokens"]
            elif last is not None:
                out.gaps_ms.append((now - last) * 1000)
                out.gap_at.append(time.time())
            last = now


def unique_schema(n_props: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:10]
    props: dict[str, Any] = {
        f"f_{tag}_{k}": {"type": random.choice(["string", "integer", "number", "boolean"])}
        for k in range(n_props)
    }
    props[f"code_{tag}"] = {"type": "string", "pattern": f"^{tag}[a-z]{{2,8}}-[0-9]{{1,4}}$"}
    return {"type": "object", "properties": props, "required": list(props)}


def attack(kind: str, eos: int, tokenize_chars: int) -> tuple[str, dict[str, Any], str]:
    """(path, body, tenant) of one amplification attempt."""
    long_prompt = FOX * 100  # ~1,500 tokens
    if kind == "prompt_logprobs":
        body = {"prompt": long_prompt, "max_tokens": 40, "prompt_logprobs": 20, "logprobs": 1, "ignore_eos": True,
                "logit_bias": {str(eos): 100}, "stream": True}  # fmt: skip
        return "/v1/completions", body, "attacker"
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": unique_schema(40)}}
    if kind == "schema":
        body = {
            "messages": [{"role": "user", "content": "Fill the form."}],
            "max_tokens": 16,
            "response_format": fmt,
        }
        return "/v1/chat/completions", body, "attacker"
    if kind == "tokenize":
        words = [uuid.uuid4().hex[: random.randint(3, 9)] for _ in range(tokenize_chars // 7)]
        return "/tokenize", {"prompt": " ".join(words)[:tokenize_chars]}, "attacker"
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 16, "response_format": fmt}
    return "/v1/chat/completions", body, "refused"


async def one_attack(http: httpx.AsyncClient, kind: str, sent: tuple[str, bytes, str], out: Phase) -> None:
    path, body, tenant = sent
    size = 0
    headers = auth(tenant) | {"content-type": "application/json"}
    try:
        async with http.stream("POST", path, content=body, headers=headers) as r:
            async for chunk in r.aiter_bytes():
                size += len(chunk)
            out.attacks[(kind, r.status_code)] += 1
    except httpx.HTTPError:
        out.attacks[(kind, 0)] += 1
    out.attack_bytes += size


async def _attack_all(
    port: int, args: argparse.Namespace, sent: list[tuple[str, tuple[str, bytes, str]]], go: Any, results: Any
) -> Phase:
    out = Phase()
    queue: asyncio.Queue[tuple[str, tuple[str, bytes, str]]] = asyncio.Queue()
    for item in sent:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
        # its connections open before `go`, as a client elsewhere would have them: a client
        # on the server's 2 cores starting its loop and connecting at `go` is the client's cost
        await asyncio.gather(*(http.get("/health") for _ in range(args.concurrency)))
        results.put("ready")
        await asyncio.to_thread(go.wait)

        async def attacker() -> None:
            while not queue.empty():
                await one_attack(http, *queue.get_nowait(), out)

        await asyncio.gather(*(attacker() for _ in range(args.concurrency)))
    return out


def attack_process(port: int, args: argparse.Namespace, eos: int, go: Any, results: Any) -> None:
    """The attacking tenant, a client of its own (a process: the bystanders' timestamps must
    not wait for this client's event loop reading a 6 MB /tokenize answer). Every body is made
    and encoded, and its connections opened, before `go`: on 2 cores the client's own work
    (130k random words per /tokenize body) would compete with the server it measures."""
    attacks = [KINDS[i % len(KINDS)] for i in range(args.attacks)]
    random.shuffle(attacks)
    sent = []
    for a in attacks:
        path, body, tenant = attack(a, eos, args.tokenize_chars)
        sent.append((a, (path, orjson.dumps(body), tenant)))
    out = asyncio.run(_attack_all(port, args, sent, go, results))
    results.put((dict(out.attacks), out.attack_bytes))


async def run_phase(port: int, args: argparse.Namespace, eos: int, attacked: bool) -> Phase:
    import multiprocessing

    out = Phase()
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=attack_process, args=(port, args, eos, go, results)) if attacked else None
    if proc is not None:
        proc.start()
        await asyncio.to_thread(results.get)  # "ready": its bodies made, its connections open
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        by = [asyncio.create_task(bystander(http, i, args.tokens, out)) for i in range(args.streams)]
        await asyncio.sleep(args.lead_s)  # the bystanders are streaming before the attack starts
        go.set()
        await asyncio.gather(*by)
        # the bystanders' own streaming time: the attacker's tail after their end is not theirs
        out.seconds = time.perf_counter() - t0
        if proc is not None:
            counts, out.attack_bytes = await asyncio.to_thread(results.get)
            out.attacks.update(counts)
            proc.join()
    return out


def warm_structured(port: int, eos: int, args: argparse.Namespace) -> None:
    """One structured request before the phases: a server's first one builds the tokenizer's
    index for llguidance (once in the server's life, unless `--structured-index-at-start`:
    1-3 s on 2 cores, holding the GIL, so every stream of the engine pauses that long). That
    is a one-time start-up cost, not an amplification a tenant can repeat; docs/protocol.md
    says what a user sees."""
    path, body, tenant = attack("schema", eos, args.tokenize_chars)
    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=auth(tenant), timeout=600)
    r.raise_for_status()


def eos_id(model: str | None) -> int:
    from transformers import PreTrainedTokenizerFast

    from wsllm.models.loader import resolve_model_dir

    tok = PreTrainedTokenizerFast.from_pretrained(str(resolve_model_dir(model)))
    return int(tok.eos_token_id)


def measure(args: argparse.Namespace) -> tuple[Phase, Phase]:
    eos = eos_id(args.model)
    port, procs = start(args)
    best: dict[bool, Phase] = {}
    try:
        asyncio.run(
            run_phase(port, argparse.Namespace(**vars(args) | {"streams": 2, "tokens": 4}), eos, False)
        )
        warm_structured(port, eos, args)
        for _, attacked in tqdm(
            [(r, a) for r in range(args.repeat) for a in (False, True)], desc="amplification"
        ):
            got = asyncio.run(run_phase(port, args, eos, attacked))
            if attacked not in best or got.worst_ms < best[attacked].worst_ms:
                best[attacked] = got
    finally:
        for proc in procs:  # the server, then its redis-server
            proc.terminate()
            proc.wait(30)
    return best[False], best[True]


def table(quiet: Phase, attacked: Phase, args: argparse.Namespace) -> str:
    rows = [
        "| bystanders | worst gap ms | p99 gap ms | tokens/s |",
        "| --- | ---: | ---: | ---: |",
        f"| alone | {quiet.worst_ms:.0f} | {quiet.p99_ms:.0f} | {quiet.tokens / quiet.seconds:,.0f} |",
        f"| with {args.attacks} amplification attempts | {attacked.worst_ms:.0f} | {attacked.p99_ms:.0f} | "
        f"{attacked.tokens / attacked.seconds:,.0f} |",
    ]
    ratio = attacked.worst_ms / quiet.worst_ms
    answers = ", ".join(f"{k} {s}: {n}" for (k, s), n in sorted(attacked.attacks.items()))
    verdict = "under" if ratio < 2 else "**over**"
    return (
        "\n".join(rows)
        + f"\n\nThe attempts move the bystanders' worst inter-token gap **{ratio:.2f}x** ({verdict} the 2x bar) "
        f"and their p99 {attacked.p99_ms / quiet.p99_ms:.2f}x. {args.streams} bystander streams of {args.tokens} "
        f"tokens; {args.attacks} attempts, {args.concurrency} at a time ({answers}; "
        f"{attacked.attack_bytes / 1e6:.1f} MB sent back to the attacker). Best of {args.repeat} runs of each phase, "
        "alternating. "
        + (
            "Served as `wsllm serve --broker redis://`: the gateway in one process, the engine in a child."
            if args.redis
            else "Served as `wsllm serve`: the gateway and the engine's thread in one process."
        )
    )


def write_docs(text: str, command: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    section = (
        "## Amplification\n\n"
        f"`{command}` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d')}).\n\n{text}\n"
    )
    old = path.read_text()
    pattern = re.compile(r"^## Amplification\n.*?(?=^## |\Z)", re.S | re.M)
    new = (
        pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    )
    path.write_text(new.rstrip() + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the engine")
    p.add_argument(
        "--batched-tokens",
        type=int,
        default=512,
        help="the engine's max_num_batched_tokens: long prompts are prefilled in chunks of this many tokens",
    )
    p.add_argument("--streams", type=int, default=16, help="bystander streams")
    p.add_argument("--tokens", type=int, default=256, help="tokens per bystander stream")
    p.add_argument("--attacks", type=int, default=200, help="amplification attempts in the attacked phase")
    p.add_argument("--concurrency", type=int, default=8, help="attempts in flight at once")
    p.add_argument("--tokenize-chars", type=int, default=900_000, help="characters of each /tokenize prompt")
    p.add_argument(
        "--lead-s", type=float, default=2.0, help="seconds the bystanders stream before the attack"
    )
    p.add_argument("--repeat", type=int, default=2, help="runs of each phase, alternating")
    p.add_argument("--smoke", action="store_true", help="a few requests of each kind, to check it runs")
    p.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks.md")
    p.add_argument("--trace", help="write the server's engine steps and event-loop stalls to this file")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the engine's gil_switch_ms (default 0.5; Python's own is 5 ms), to compare GIL hand-over",
    )
    p.add_argument(
        "--prefill-ms",
        type=float,
        default=None,
        help="the engine's prefill_ms_while_decoding (default: the engine's own), to compare pacing",
    )
    p.add_argument(
        "--redis",
        action="store_true",
        help="serve as `wsllm serve --broker redis://` does (a redis-server, the engine in a child process)",
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(
            args.port, args.model, args.threads, args.batched_tokens, args.trace, args.switch_interval_ms,
            args.prefill_ms,
        )  # fmt: skip
    if args.smoke:
        args.streams, args.tokens, args.attacks, args.concurrency, args.repeat = 2, 24, 8, 2, 1
        args.tokenize_chars, args.lead_s = 20_000, 0.5
    quiet, attacked = measure(args)
    text = table(quiet, attacked, args)
    print(text)
    if args.trace:  # where the worst gaps ended, to read against the trace file
        worst = sorted(zip(attacked.gaps_ms, attacked.gap_at, strict=True), reverse=True)[:8]
        print("worst attacked gaps (ms @ wall):", ", ".join(f"{g:.0f} @ {t:.3f}" for g, t in worst))
    if args.write_docs:
        flags = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        write_docs(text, f"python bench/amplification.py {flags}".strip())


if __name__ == "__main__":
    main()
