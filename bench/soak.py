"""The soak: a Redis deployment (one gateway, two engines, one redis-server, each a
process; the second engine is the child of a `wsllm serve --broker redis://`, which
supervises it) held at twice its measured capacity for N minutes, with faults, checked for
what a long run shows and a short test does not: a request that never ends, a KV block
or a Redis key left behind, memory that creeps, latency that drifts.

    python bench/soak.py --minutes 30          # the record (docs/reliability.md)
    python bench/soak.py --smoke               # 90 s of load, about 3 minutes in all (make test)

1. Start the deployment (the bundled SmolLM2 unless `--model`), wait until it is ready.
2. Measure its capacity: closed-loop clients of the whole mix, answers per second.
3. Warm up, then run open-loop (Poisson) arrivals at twice that rate for the run, the mix
   of bench/soak_load.py: chat, completions, responses, messages, embeddings, structured
   output, n > 1, beams, streams cancelled, clients that leave mid-stream, WebSocket
   resumes. The faults, at fractions of the run (`FAULTS`): a request of death (its prompt
   holds the token of the engines' test-only hold, `WSLLM_TEST_HOLD_STEP_TOKEN`: every
   step that runs it stalls its engine), which must end with `engine_stalled` after at
   most two engines, both restarted by their supervisors (this script for `wsllm engine`,
   restarting an engine that exits 2 s later, as compose's restart policy would; `wsllm
   serve` for its child); serve's engine child killed (SIGKILL), which serve restarts;
   the other engine killed (SIGKILL) and restarted 2 s later; Redis restarted (SIGTERM,
   then the same AOF).
4. Stop the arrivals and wait for every request to end; then for the engines to be idle
   and the request keys to expire.

It reports every request's end, by kind; p50/p99 latency of the admitted requests that
finished, by window (a sixth of the run: 5 minutes of the record; the smoke's is a
third); resident memory of
every process (with its children) by window; free KV blocks and leftover Redis keys at
the end. And it checks, exiting 1 when one fails:
- every request ended: whole, cancelled by its client, or a clear error (no request
  hung past its deadline, no broken connection, no internal_error);
- no KV block and no request's Redis key left behind;
- each process's resident memory in the last two thirds of the run no more than 5%
  over its first window (or 2 MB: Redis's allocator moves by a megabyte of its 20; a
  restarted process counts from its first whole window after it served again; memory
  that goes down is no leak);
- p99 latency of the admitted requests in the last window within 1.5x of the first (not
  in the smoke: its short windows all hold faults and their restarts);
- the request of death ended with `engine_stalled`, and no more than two engines exited
  with status 3 (a stall) for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmem import tree_rss_mb  # noqa: E402
from soak_load import Load, Outcome  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["sk-soak-alice", "sk-soak-bob"]
KEYS_FILE = '[tenants.alice]\nkeys = ["sk-soak-alice"]\n\n[tenants.bob]\nkeys = ["sk-soak-bob"]\n'
# short broker times, so that recovery and expiry happen within the run's patience
BROKER_FLAGS = ["--lease-s", "3", "--engine-heartbeat-s", "0.3", "--engine-ttl-s", "3",
                "--stream-retention-s", "3", "--resume-grace-s", "3", "--history-flush-s", "0.5",
                "--drain-timeout-s", "1"]  # fmt: skip
# the stall timeout bounds what the request of death costs: the mix's steps take well under it
ENGINE_FLAGS = ["--threads", "1", "--max-num-seqs", "16", "--num-kv-blocks", "512", "--stall-timeout-s", "10"]
DEATH_TOKEN = 49151  # the engines' test-only hold: every step running a prompt with it stalls
# the faults, at these fractions of the run (apart: an engine's restart takes 5-15 s on a loaded machine)
FAULTS = {"death": 0.05, "kill_engine": 0.3, "kill_serve_child": 0.55, "restart_redis": 0.8}
GATEWAY_FLAGS = ["--no-frontend", "--max-queue-depth", "24", "--queue-timeout-s", "30",
                 "--orphan-timeout-s", "15", "--response-ttl-s", "20", "--max-requests-per-socket", "8"]  # fmt: skip
# the mix: kind -> weight
MIX = {"chat_stream": 3, "completion": 3, "responses": 2, "messages": 2, "embeddings": 2, "structured": 1,
       "n_choices": 1, "beam": 1, "cancel_stream": 1, "ws_leave": 1, "ws_resume": 2}  # fmt: skip
WINDOWS = 6  # the record's: 5 minutes each; the smoke's 3 (a few seconds each would be noise)
ENDS = ("done", "cancelled", "error", "failed")  # the columns of the ends by kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """One process of the deployment, one incarnation of it (a restart is another)."""

    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready: float | None = None  # when it served (its first whole window starts after)
    stopped: float | None = None  # when it was told to stop (its last whole window ends before)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (time.monotonic(), MB)

    def start(self) -> Proc:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["WSLLM_TEST_HOLD_STEP_TOKEN"] = str(DEATH_TOKEN)  # what the engines (only) read
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.started = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 15) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        self.stopped = time.monotonic()
        self.popen.send_signal(sig)
        try:
            self.popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


class Deployment:
    """redis-server, a `wsllm engine` (engine-1), a `wsllm serve --broker redis://` whose
    engine child is the second engine, and one `wsllm gateway`, each a process. This
    script supervises engine-1 as compose would: started again 2 s after it exits."""

    def __init__(self, workdir: Path, model: str | None) -> None:
        self.dir, self.model = workdir, model
        self.redis_port, self.port, self.serve_port = free_port(), free_port(), free_port()
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []  # every incarnation, for the memory report
        self.live: dict[str, Proc] = {}
        (workdir / "keys.toml").write_text(KEYS_FILE)
        self._stop = threading.Event()

    def _wsllm(self, *args: str) -> list[str]:
        model = ["--model", self.model] if self.model else []
        return [sys.executable, "-m", "wsllm", args[0], *model, "--broker", self.url, "--log-level", "warning",
                *BROKER_FLAGS, *args[1:]]  # fmt: skip

    def _start(self, name: str, cmd: list[str]) -> Proc:
        n = sum(p.name.split("#")[0] == name for p in self.procs)
        proc = Proc(f"{name}#{n + 1}" if n else name, cmd, self.dir / f"{name}.log").start()
        self.procs.append(proc)
        self.live[name] = proc
        return proc

    def start_redis(self) -> None:
        exe = shutil.which("redis-server") or "redis-server"
        self._start("redis", [exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                              "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                              "--maxmemory", "512mb", "--maxmemory-policy", "noeviction"])  # fmt: skip
        deadline = time.monotonic() + 20
        while not _pings(self.url):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def start_engine(self, i: int) -> None:
        self._start(f"engine-{i}", self._wsllm("engine", "--engine-id", f"soak-e{i}", *ENGINE_FLAGS))

    def start_serve(self) -> None:
        """`wsllm serve --broker redis://`: a gateway of its own and the engine child soak-e2."""
        keys = str(self.dir / "keys.toml")
        flags = ["--port", str(self.serve_port), "--engine-id", "soak-e2", "--api-keys-file", keys]
        self._start("serve", self._wsllm("serve", *flags, *ENGINE_FLAGS, *GATEWAY_FLAGS))

    def start(self) -> None:
        self.start_redis()
        self.start_engine(1)
        self.start_serve()
        keys = str(self.dir / "keys.toml")
        self._start(
            "gateway",
            self._wsllm("gateway", "--port", str(self.port), "--api-keys-file", keys, *GATEWAY_FLAGS),
        )
        self.wait_ready(2)
        threading.Thread(target=self._sample, daemon=True).start()
        threading.Thread(target=self._supervise, daemon=True).start()

    def _supervise(self) -> None:
        """engine-1's supervisor: started again 2 s after it exits by itself (a stall)."""
        while not self._stop.wait(0.2):
            proc = self.live.get("engine-1")
            if proc is None or proc.alive() or proc.stopped is not None or proc.popen is None:
                continue
            proc.stopped = time.monotonic()
            time.sleep(2.0)
            self.start_engine(1)
            self.live["engine-1"].ready = time.monotonic() + 10  # its load, roughly

    def stalls_of(self, message: str) -> int:
        """How many engines stalled holding the request that `message` (its error) names:
        the engines' logs name what each stalled engine handed back or ended."""
        named = re.search(r"request (\S+) is not handed", message)
        if named is None:
            return 0
        logs = [(self.dir / f"{name}.log").read_text(errors="replace") for name in ("engine-1", "serve")]
        return sum(
            1 for log in logs for line in log.splitlines() if "handed back" in line and named[1] in line
        )

    def wait_ready(self, engines: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        headers = {"authorization": f"Bearer {KEYS[0]}"}
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = httpx.get(f"{self.base}/ready", headers=headers, timeout=2)
                if r.status_code == 200 and r.json()["engines"] >= engines:
                    return
            # engines and Redis may be down a while (a fault): only the gateways must live
            dead = [p.name for name, p in self.live.items() if not p.alive() and name in ("gateway", "serve")]
            assert not dead and time.monotonic() < deadline, f"not ready; exited: {dead}; see {self.dir}"
            time.sleep(0.2)

    def _sample(self) -> None:
        """Every process's resident memory (with its children), once a second."""
        while not self._stop.wait(1.0):
            for p in list(self.live.values()):
                if p.alive() and p.popen is not None:
                    p.rss.append((time.monotonic(), tree_rss_mb(p.popen.pid)))

    def kill_engine(self, i: int, down_s: float = 2.0) -> None:
        """SIGKILL engine `i`; its supervisor starts it again after `down_s` (the same id:
        it takes up what it held)."""
        self.live[f"engine-{i}"].stop(signal.SIGKILL)
        time.sleep(down_s)
        if not self.live[f"engine-{i}"].alive():  # unless the supervisor thread did already
            self.start_engine(i)
        self.wait_ready(2)
        self.live[f"engine-{i}"].ready = time.monotonic()

    def kill_serve_child(self) -> None:
        """SIGKILL serve's engine child once it serves (a stall may have restarted it just
        before); serve starts it again by itself."""
        serve = self.live["serve"]
        assert serve.popen is not None
        from procmem import tree

        deadline = time.monotonic() + 120
        while not _healthy(f"http://127.0.0.1:{self.serve_port}"):
            assert time.monotonic() < deadline and serve.alive(), (
                f"serve's engine never served; see {self.dir}"
            )
            time.sleep(0.2)
        child = [p for p in tree(serve.popen.pid) if p != serve.popen.pid][0]
        os.kill(child, signal.SIGKILL)
        time.sleep(1.0)
        self.wait_ready(2)
        serve.ready = time.monotonic()  # its tree's memory counts again from here

    def restart_redis(self) -> None:
        """Redis stops (SIGTERM: the AOF is flushed) and starts again on its data."""
        self.live["redis"].stop(signal.SIGTERM, 30)
        self.start_redis()
        self.live["redis"].ready = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        for name in ("gateway", "engine-1", "serve", "redis"):
            if name in self.live:
                self.live[name].stop()


def request_of_death(dep: Deployment, model: str, patience_s: float = 240.0) -> dict[str, Any]:
    """A request that stalls every engine it reaches: its answer (a clear engine_stalled). At
    twice the capacity the gateway may refuse it before any engine sees it (a 429: the queue
    is full, or its key's rate); it is sent again as an SDK retries, until an engine took it."""
    body = {"model": model, "prompt": [DEATH_TOKEN, 5, 6, 7], "max_tokens": 8}
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    give_up = time.monotonic() + patience_s
    refused = 0
    while True:
        try:
            r = httpx.post(f"{dep.base}/v1/completions", json=body, headers=headers, timeout=120)
            err = r.json().get("error") or {}
        except (httpx.HTTPError, ValueError) as e:
            return {"status": None, "code": None, "message": f"{type(e).__name__}: {e}", "refused": refused}
        if r.status_code != 429 or time.monotonic() > give_up:
            message = err.get("message", "")
            return {"status": r.status_code, "code": err.get("code"), "message": message, "refused": refused}
        refused += 1
        time.sleep(1.0)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.exceptions.RedisError:
        return False


# -- the load -----------------------------------------------------------------------------


def _kinds(rng: random.Random, n: int, kinds: list[str]) -> list[str]:
    return rng.choices(kinds, weights=[MIX[k] for k in kinds], k=n)


async def capacity(load: Load, seconds: float, clients: int) -> float:
    """Answers per second of closed-loop clients running the mix (whole answers only)."""
    kinds = [k for k in MIX if k not in ("cancel_stream", "ws_leave")]
    stop_at = time.monotonic() + seconds
    done = 0

    async def client(rng: random.Random) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            out = await load.one(_kinds(rng, 1, kinds)[0])
            done += out.end == "done" and out.stop <= stop_at

    await asyncio.gather(*(client(random.Random(i)) for i in range(clients)))
    return done / seconds


async def open_loop(
    load: Load, rate: float, seconds: float, faults: list[tuple[float, Any]]
) -> list[Outcome]:
    """Poisson arrivals of the mix at `rate` per second for `seconds`, each run to its
    end; `faults`: (fraction of the run, a blocking call), run off the loop when due."""
    rng = random.Random(37)
    t0 = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    pending_faults = sorted(faults, key=lambda f: f[0])
    fault_tasks = []
    while (now := time.monotonic()) < t0 + seconds:
        while pending_faults and now >= t0 + pending_faults[0][0] * seconds:
            fault_tasks.append(asyncio.create_task(asyncio.to_thread(pending_faults.pop(0)[1])))
        tasks.append(asyncio.create_task(load.one(_kinds(rng, 1, list(MIX))[0])))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*fault_tasks)
    return list(await asyncio.gather(*tasks))


# -- the end --------------------------------------------------------------------------------


def engines_idle(url: str) -> dict[str, dict[str, Any]]:
    """Each registered engine's last stats (its heartbeat in Redis)."""
    from wsllm.broker.redis_keys import Keys

    r, keys = redis.Redis.from_url(url), Keys("wsllm")
    out = {}
    for e in r.smembers(keys.engines):
        raw = r.get(keys.engine(e.decode()))
        if raw:
            out[e.decode()] = json.loads(raw)["stats"]
    return out


def leftovers(url: str) -> dict[str, int]:
    """What a finished run must not leave in Redis: requests' result streams and resume
    counters, waiting or pending queue entries, tenants' leases."""
    from wsllm.broker.redis_keys import Keys

    r, keys = redis.Redis.from_url(url), Keys("wsllm")
    left: dict[str, int] = {}
    for k in r.scan_iter(count=1000):
        name = k.decode()
        if ":o:" in name or ":att:" in name:
            left["request streams"] = left.get("request streams", 0) + 1
        elif name.endswith(":live") and r.zcount(k, f"({int(time.time() * 1000)}", "+inf"):
            left["leases"] = left.get("leases", 0) + 1
        elif ":z" in name.rsplit("}", 1)[-1] and r.type(k) == b"zset" and r.zcard(k):
            left["waiting"] = left.get("waiting", 0) + int(r.zcard(k))
    for e in r.smembers(keys.engines):
        with contextlib.suppress(redis.exceptions.ResponseError):
            model = json.loads(r.get(keys.engine(e.decode())) or b'{"model": ""}')["model"]
            pending = r.xpending(keys.queue(model), "engines")["pending"]
            if pending:
                left["pending"] = left.get("pending", 0) + int(pending)
    return left


def settle(dep: Deployment, timeout: float) -> tuple[dict[str, Any], dict[str, int], float]:
    """Wait until the engines are idle with every block free and no request key is left
    (or `timeout`); (engine stats, leftovers, seconds waited)."""
    t0 = time.monotonic()
    while True:
        stats, left = engines_idle(dep.url), leftovers(dep.url)
        idle = stats and all(s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0
                             and s["num_free_blocks"] == s["num_total_blocks"] for s in stats.values())  # fmt: skip
        if (idle and not left) or time.monotonic() - t0 > timeout:
            return stats, left, time.monotonic() - t0
        time.sleep(0.5)


# -- the report -----------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def windows(outcomes: list[Outcome], t0: float, window_s: float, n: int) -> list[dict[str, float]]:
    """p50/p99 end-to-end latency of the admitted requests that finished, by window of
    their start."""
    out = []
    for w in range(n):
        lat = [o.stop - o.start for o in outcomes
               if o.end == "done" and o.admitted and w == min(n - 1, int((o.start - t0) / window_s))]  # fmt: skip
        out.append({"n": len(lat), "p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99)})
    return out


def memory(procs: list[Proc], t0: float, window_s: float, n: int) -> dict[str, list[float | None]]:
    """Each process's median resident MB by window (None: not alive the whole window)."""
    out: dict[str, list[float | None]] = {}
    for p in procs:
        row: list[float | None] = []
        for w in range(n):
            lo, hi = t0 + w * window_s, t0 + (w + 1) * window_s
            xs = [mb for t, mb in p.rss if lo <= t < hi]
            whole = (p.ready or p.started) <= lo and xs and (p.stopped or math.inf) >= hi
            row.append(statistics.median(xs) if whole else None)
        out[p.name] = row
    return out


def checks(ends: dict[str, int], failed: list[Outcome], stats: dict[str, Any], left: dict[str, int],
           rss: dict[str, list[float | None]], lat: list[dict[str, float]],
           death: dict[str, Any], smoke: bool) -> dict[str, str]:  # fmt: skip
    """Each invariant: "" when it holds, else why not."""
    out = {
        "every request ended": ""
        if not failed
        else f"{len(failed)} did not: {sorted({o.end for o in failed})[:5]}"
    }
    bad_kv = {
        e: s for e, s in stats.items() if s["num_free_blocks"] != s["num_total_blocks"] or s["num_running"]
    }
    out["no KV block left"] = (
        "" if stats and not bad_kv else f"engines not idle: {bad_kv or 'none registered'}"
    )
    out["no Redis key left"] = "" if not left else f"left: {left}"
    creep = []
    for name, row in rss.items():
        first = next((x for x in row if x is not None), None)
        late = [x for x in row[len(row) // 3 :] if x is not None]
        if first is not None and any(x > first + max(0.05 * first, 2.0) for x in late):  # creeping up
            creep.append(f"{name}: {first:.0f} MB -> {[round(x) for x in late]}")
    out["memory no more than 5% over the first window"] = "; ".join(creep)
    first, last = lat[0]["p99"], lat[-1]["p99"]
    ok = not (math.isnan(first) or math.isnan(last)) and last <= 1.5 * first
    if not smoke:  # the smoke's windows all hold faults and their restarts: no steady ones to compare
        out["p99, last window within 1.5x of the first"] = "" if ok else f"{first:.2f} s -> {last:.2f} s"
    stalled = death.get("stalls", 0)
    # engine_stalled; or worker_lost when every engine was down past --orphan-timeout-s
    # meanwhile (a clear end too): never more than two engines stalled holding it
    lost = death.get("code") == "worker_lost" and "no engine of this model" in death.get("message", "")
    ok = (death.get("code") == "engine_stalled" and 1 <= stalled <= 2) or (lost and stalled <= 2)
    out["the request of death: engine_stalled, at most two engines stalled"] = (
        "" if ok else f"it ended {death.get('status')} {death.get('code')!r}, {stalled} engines stalled"
    )
    return out


def report(result: dict[str, Any]) -> str:
    lines = [f"capacity {result['capacity_per_s']:.2f} answers/s; offered {result['rate_per_s']:.2f}/s "
             f"for {result['run_s']:.0f} s ({result['requests']} requests), windows of {result['window_s']:.0f} s",
             "", "| end | requests |", "| --- | --- |"]  # fmt: skip
    lines += [f"| {end} | {n} |" for end, n in sorted(result["ends"].items(), key=lambda x: -x[1])]
    lines += ["", "| kind | " + " | ".join(ENDS) + " |", "| --- |" + " --- |" * len(ENDS)]
    for kind, row in result["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(row.get(e, 0)) for e in ENDS) + " |")
    lines += ["", "| window | finished | p50 s | p99 s |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {i + 1} | {w['n']} | {w['p50']:.2f} | {w['p99']:.2f} |" for i, w in enumerate(result["latency"])
    ]
    n = len(result["latency"])
    lines += ["", "| process | " + " | ".join(f"w{i + 1} MB" for i in range(n)) + " |",
              "| --- |" + " --- |" * n]  # fmt: skip
    for name, row in result["rss_mb"].items():
        lines.append(f"| {name} | " + " | ".join("-" if x is None else f"{x:.0f}" for x in row) + " |")
    free = {e: f"{s['num_free_blocks']}/{s['num_total_blocks']}" for e, s in result["engines"].items()}
    lines += ["", f"free KV blocks at the end: {free}; leftover Redis keys: {result['leftovers'] or 'none'} "
              f"(settled in {result['settle_s']:.1f} s)", ""]  # fmt: skip
    death = result.get("death", {})
    lines += [f"the request of death: {death.get('status')} {death.get('code')}, {death.get('stalls')} engines "
              "stalled by it", ""]  # fmt: skip
    lines += [f"- {'ok' if not why else 'FAILED'}: {name}{'' if not why else ': ' + why}"
              for name, why in result["checks"].items()]  # fmt: skip
    return "\n".join(lines)


async def soak(dep: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    models = httpx.get(f"{dep.base}/v1/models", headers={"authorization": f"Bearer {KEYS[0]}"}).json()
    load = Load(dep.base, models["data"][0]["id"], KEYS, deadline_s=60 if args.smoke else 180)
    try:
        cap = await capacity(load, args.capacity_s, 32)
        rate = max(0.5, 2 * cap)
        run_s = args.minutes * 60
        await open_loop(load, rate, args.warm_s, [])  # warm up (not counted)
        t0 = time.monotonic()
        death: dict[str, Any] = {}
        calls = {
            "death": lambda: death.update(request_of_death(dep, load.model)),
            "kill_engine": lambda: dep.kill_engine(1),
            "kill_serve_child": dep.kill_serve_child,
            "restart_redis": dep.restart_redis,
        }
        outcomes = await open_loop(load, rate, run_s, [(FAULTS[name], call) for name, call in calls.items()])
    finally:
        await load.aclose()
    stats, left, waited = await asyncio.to_thread(settle, dep, 60)
    death["stalls"] = dep.stalls_of(death.get("message", ""))
    n = 3 if args.smoke else WINDOWS
    window_s = run_s / n
    ends: dict[str, int] = {}
    for o in outcomes:
        end = "broken" if o.end.startswith("broken") else o.end
        ends[end] = ends.get(end, 0) + 1
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        end = "failed" if o.failed else "error" if o.end.startswith("error") else o.end
        by_kind.setdefault(o.kind, {})[end] = by_kind.setdefault(o.kind, {}).get(end, 0) + 1
    lat = windows(outcomes, t0, window_s, n)
    rss = memory(dep.procs, t0, window_s, n)
    failed = [o for o in outcomes if o.failed]
    return {"capacity_per_s": cap, "rate_per_s": rate, "run_s": run_s, "window_s": window_s,
            "requests": len(outcomes), "ends": ends, "by_kind": by_kind, "latency": lat, "rss_mb": rss, "engines": stats,
            "leftovers": left, "settle_s": waited, "failed": [asdict(o) for o in failed[:50]], "death": death,
            "checks": checks(ends, failed, stats, left, rss, lat, death, args.smoke)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="the measured run (30 for the record)")
    p.add_argument(
        "--smoke", action="store_true", help="90 s of load and short warm-up: about 3 minutes in all"
    )
    p.add_argument("--model", default=None, help="the model the engines serve (default: the bundled SmolLM2)")
    p.add_argument(
        "--capacity-s", type=float, default=None, help="the capacity's measurement (60 s; smoke 6)"
    )
    p.add_argument(
        "--warm-s", type=float, default=None, help="load before the run, not counted (120 s; smoke 10)"
    )
    p.add_argument("--json", default=None, help="write the whole result here")
    p.add_argument(
        "--keep", action="store_true", help="keep the processes' logs (their directory is printed)"
    )
    args = p.parse_args()
    if args.smoke:
        args.minutes = 1.5  # room for four faults, each with its restart, one after the other
    args.capacity_s = args.capacity_s or (6.0 if args.smoke else 60.0)
    args.warm_s = args.warm_s or (10.0 if args.smoke else 120.0)
    workdir = Path(tempfile.mkdtemp(prefix="wsllm-soak-"))
    dep = Deployment(workdir, args.model)
    try:
        dep.start()
        result = asyncio.run(soak(dep, args))
    finally:
        dep.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs: {workdir}", file=sys.stderr)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if any(result["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
