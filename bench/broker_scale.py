"""The broker at scale: fake engines and thousands of streams against one Redis and
against a Redis Cluster, in the same run, with the same load.

Each configuration starts its redis-server(s) (one instance; N masters joined with
`redis-cli --cluster create`), every server held to the same CPU budget (`--redis-cpu`
cores, a cgroup quota: see bench/scale_redis.py), then `--engines` fake engines
(`FakeEngine`: no model, steps of `--step-ms`, on the real worker and broker code; several
per process, bench/scale_procs.py), `--gateways` `wsllm gateway` processes and
`--clients` load clients keeping `--streams` WebSocket requests in flight. The model
names (`--models`, all the same tokenizer) are chosen so that each master owns the same
number of them; requests go round the names. After `--warmup-s` it measures for
`--duration-s`:

- tokens/s: tokens received by the clients in the window (as they arrive, so that
  requests still running count);
- Redis CPU per server (/proc/PID/stat) and the share of its quota periods throttled
  (near 1: Redis was the bound), commands per token (INFO commandstats);
- added latency: time to first token less one step, p50 and p99, and the gap between
  a stream's deltas (one step when nothing adds to it; 0 when deltas arrive together),
  p50 and p99 (the engines have room for every stream, so what is added is the
  broker's, the gateways' and the machine's; at saturation, the wait for a share of
  the bound);
- Redis memory per live stream (used_memory with the streams live, less before).

- CPU per token of each process role (gateways, engines, load clients).

It runs as root (the cgroup) and needs a build with Redis Cluster URLs
(`redis+cluster://`) for the cluster half; without one it measures one instance only.

    python bench/broker_scale.py --smoke                     # seconds: 6 engines, 120 streams
    python bench/broker_scale.py                             # 64 engines, 2000 streams, 1 instance vs 3 shards
    python bench/broker_scale.py --streams 5000 --gateways 4 # the issue's 5,000 (gateways fall behind on 2 cores)
    python bench/broker_scale.py --redis-url redis://h:6379/0    # only that Redis, no cap
    python bench/broker_scale.py --write-docs                # also docs/benchmarks.md and docs/scaling.md
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_procs  # noqa: E402
import scale_redis  # noqa: E402
import scale_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = random.randrange(20000, 45000)
        with contextlib.suppress(OSError), socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 10000))
            return port


class Run:
    """The processes of one configuration; `stop()` ends them all."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.roles: dict[int, str] = {}  # pid -> gateway | engines | load
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        self.procs.append(p)
        self.roles[p.pid] = name.split("-")[0]
        return p

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each role's processes together."""
        out: dict[str, float] = {}
        for pid, role in self.roles.items():
            with contextlib.suppress(OSError):
                out[role] = out.get(role, 0.0) + scale_redis.cpu_seconds(pid)
        return out

    def child(self, role: str, *flags: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--role", role, *flags]

    def start_engines(self, url: str, model_dir: Path, names: list[str]) -> None:
        a = self.args
        per = math.ceil(a.engines / a.engine_procs)
        for first in range(0, a.engines, per):
            count = min(per, a.engines - first)
            flags = ["--url", url, "--model-dir", str(model_dir), "--names", ",".join(names)]
            flags += ["--count", str(count), "--first", str(first), "--step-ms", str(a.step_ms)]
            self.spawn(
                f"engines-{first}", self.child("engines", *flags, "--max-num-seqs", str(a.max_num_seqs))
            )

    def start_gateways(self, url: str, model_dir: Path, name: str) -> list[str]:
        bases = []
        for _ in range(self.args.gateways):
            port = free_port()
            cmd = [sys.executable, "-m", "wsllm", "gateway", "--model", str(model_dir), "--model-name", name]
            cmd += ["--broker", url, "--port", str(port), "--no-frontend", "--log-level", "warning"]
            cmd += ["--anonymous-rpm", "0", "--anonymous-tpm", "0", "--anonymous-max-concurrent", "0"]
            cmd += ["--max-queue-depth", "100000", "--max-requests-per-socket", str(self.args.per_socket)]
            self.spawn(f"gateway-{port}", cmd)
            bases.append(f"http://127.0.0.1:{port}")
        return bases

    def wait_ready(self, bases: list[str], timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for base in bases:
            while True:
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    r = httpx.get(f"{base}/ready", timeout=5)
                    if r.status_code == 200 and r.json()["engines"] >= self.args.engines:
                        break
                dead = [p.args for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"not ready ({base}); exited: {dead}; logs in {self.workdir}")
                time.sleep(0.5)

    def start_load(self, bases: list[str], names: list[str], run_s: float) -> list[tuple[Any, Path]]:
        a = self.args
        out = []
        per = math.ceil(a.streams / a.clients)
        for first in range(0, a.streams, per):
            path = self.workdir / f"load-{first}.json"
            flags = ["--gateway-urls", ",".join(bases), "--names", ",".join(names), "--streams"]
            flags += [str(min(per, a.streams - first)), "--first", str(first), "--run-s", str(run_s)]
            flags += [
                "--out",
                str(path),
                "--per-socket",
                str(a.per_socket),
                "--max-tokens",
                str(a.max_tokens),
            ]
            flags += ["--ramp-s", str(min(a.warmup_s / 2, 10.0)), "--prompt-tokens", str(a.prompt_tokens)]
            out.append((self.spawn(f"load-{first}", self.child("load", *flags)), path))
        return out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def model_dir() -> Path:
    """SmolLM2's tokenizer: what the fake engines publish and the gateways detokenize with."""
    from wsllm.models.loader import resolve_model_dir

    return resolve_model_dir(None, weights=False)


def measure(args: argparse.Namespace, label: str, shards: int, workdir: Path) -> scale_report.Row:
    """One configuration: `shards` 0 is `--redis-url` as it is, 1 one instance, N a cluster."""
    dep = None
    if shards:
        ports = [cluster_port() if shards > 1 else free_port() for _ in range(shards)]
        dep = scale_redis.start(ports, workdir / "redis", shards > 1, args.redis_cpu, str(os.getpid()))
        if args.redis_cpu and not dep.capped:
            print("warning: no writable cgroup here; the servers run uncapped", file=sys.stderr)
    url = dep.url if dep else args.redis_url
    per_shard = args.models // max(1, shards) if shards > 1 else args.models
    names = scale_redis.names_per_shard(dep, per_shard) if dep else [f"fake-{i}" for i in range(args.models)]
    run = Run(args, workdir)
    try:
        tok = model_dir()
        run.start_engines(url, tok, names)
        bases = run.start_gateways(url, tok, names[0])
        run.wait_ready(bases)
        mem0 = sum(n.memory() for n in dep.nodes) if dep else 0
        start = time.time()
        clients = run.start_load(bases, names, args.warmup_s + args.duration_s)
        t0 = float(math.ceil(start + args.warmup_s))  # whole seconds: tokens are counted per second
        time.sleep(max(0.0, t0 - time.time()))
        s0, c0 = (dep.sample() if dep else []), run.cpu()
        t1 = t0 + math.ceil(args.duration_s)
        time.sleep(max(0.0, t1 - time.time()))
        s1, c1 = (dep.sample() if dep else []), run.cpu()
        mem1 = sum(n.memory() for n in dep.nodes) if dep else 0
        results, failures, by_s, latencies = _collect(clients, args)
    finally:
        run.stop()
        if dep:
            dep.stop()
    for f in failures[:5]:
        print(f"  {label}: a socket failed: {f}", file=sys.stderr)
    tokens = sum(n for sec, n in by_s.items() if t0 <= sec < t1)
    row = scale_report.row(
        label, args, results, tokens, s0, s1, t0, t1, (mem1 - mem0) / args.streams, latencies
    )
    row.cpu_us = {role: (c1.get(role, 0.0) - c0.get(role, 0.0)) / max(1, tokens) * 1e6 for role in c0}
    return row


def _collect(
    clients: list[tuple[Any, Path]], args: argparse.Namespace
) -> tuple[list[Any], list[str], dict[int, int], dict[str, list[Any]]]:
    results: list[Any] = []
    failures: list[str] = []
    by_s: dict[int, int] = {}
    latencies: dict[str, list[Any]] = {"ttfts": [], "gaps": []}
    for proc, path in clients:
        try:
            proc.wait(args.warmup_s + args.duration_s + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if path.exists():
            data = orjson.loads(path.read_bytes())
            results += data["results"]
            failures += data["failures"]
            for sec, n in data["tokens_by_s"].items():
                by_s[int(sec)] = by_s.get(int(sec), 0) + n
            latencies["ttfts"] += data["ttfts"]
            latencies["gaps"] += data["gaps"]
        else:
            failures.append(f"load client {proc.args[-1]} wrote nothing")
    return results, failures, by_s, latencies


def cluster_supported() -> bool:
    from wsllm.config_redis import RedisConfig

    try:
        return RedisConfig(broker="redis+cluster://127.0.0.1:1").uses_redis
    except ValueError:
        return False


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--engine-procs", type=int, default=8, help="processes the engines share (threads)")
    p.add_argument("--streams", type=int, default=2000, help="up to 5000 fit in 2 cores and 20 GB")
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--clients", type=int, default=2, help="load client processes")
    p.add_argument("--per-socket", type=int, default=32, help="streams on one WebSocket")
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--max-num-seqs", type=int, default=256, help="per engine: room for every stream")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--models", type=int, default=6, help="model names (a multiple of --cluster)")
    p.add_argument("--cluster", type=int, default=3, help="masters of the cluster configuration (0: none)")
    p.add_argument(
        "--redis-cpu", type=float, default=0.01, help="cores each redis-server may use (0: no cap)"
    )
    p.add_argument("--redis-url", default=None, help="measure this Redis only, as it is (no cap, no stats)")
    p.add_argument("--warmup-s", type=float, default=15.0)
    p.add_argument("--duration-s", type=float, default=45.0)
    p.add_argument("--smoke", action="store_true", help="a few engines and streams for seconds")
    p.add_argument("--write-docs", action="store_true")
    scale_procs.add_child_arguments(p)
    args = p.parse_args()
    if args.smoke:
        args.engines, args.engine_procs, args.streams, args.gateways, args.clients = 6, 1, 120, 1, 1
        args.warmup_s, args.duration_s = 4.0, 8.0
    return args


def main() -> None:
    args = parse_args()
    if args.role == "engines":
        return scale_procs.run_engines(args)
    if args.role == "load":
        return scale_procs.run_load(args)
    configs = [("one instance", 1)]
    if args.redis_url:
        configs = [(args.redis_url, 0)]
    elif args.cluster > 1 and cluster_supported():
        configs.append((f"{args.cluster}-shard cluster", args.cluster))
    elif args.cluster > 1:
        print(
            "this build has no Redis Cluster client (redis+cluster:// URLs): one instance only",
            file=sys.stderr,
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="broker-scale-") as tmp:
        for label, shards in configs:
            print(f"{label}: {args.engines} engines, {args.streams} streams ...", flush=True)
            rows.append(measure(args, label, shards, Path(tmp) / f"{shards}"))
            print(scale_report.table(rows[-1:], args).split("\n\n")[0], flush=True)
    text = scale_report.table(rows, args)
    print(text)
    if args.write_docs:
        scale_report.write_docs(text)


if __name__ == "__main__":
    main()
