"""The Redis side of bench/broker_scale.py: redis-server processes (one instance, or the
masters of a Redis Cluster made with `redis-cli --cluster create`), each held to the same
CPU budget, and what they did in a window (CPU seconds, commands, throttling).

Why a CPU budget: the bench runs on one small machine where the load client, the
gateways and the fake engines need the cores too. To ask "does a 3-shard cluster carry
3x the traffic of one instance" the shards must each be bound the way a Redis on its own
machine is, by its own CPU, and not by the machine's others. So every redis-server gets
the same quota of CPU time (cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`, as root),
small enough that Redis is what saturates first in both configurations; the throttled
share of its periods says that it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Node:
    """One redis-server on a local port, optionally in a CPU-capped cgroup."""

    port: int
    workdir: Path
    cluster: bool = False
    proc: subprocess.Popen[bytes] | None = None
    cgroup: Path | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (sudo apt-get install -y redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(self.workdir), "--maxclients", "20000"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
            cmd += ["--cluster-node-timeout", "15000"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if self.client().ping():
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start; see {self.workdir}/redis.log")
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cap(self, cores: float, name: str) -> bool:
        """Hold this server to `cores` of CPU time; False when no cgroup is writable here."""
        period = max(10_000, int(1000 / cores))  # quotas under 1 ms are refused: lengthen the period
        quota = max(1000, int(cores * period))
        for root, v2 in ((CGROUP_V2, True), (CGROUP_V1, False)):
            if v2 and not (root / "cgroup.controllers").exists():
                continue
            group = root / name
            try:
                group.mkdir(exist_ok=True)
                if v2:
                    (group / "cpu.max").write_text(f"{quota} {period}")
                else:
                    (group / "cpu.cfs_period_us").write_text(str(period))
                    (group / "cpu.cfs_quota_us").write_text(str(quota))
                (group / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                continue
            self.cgroup = group
            return True
        return False

    def sample(self) -> dict[str, Any]:
        """Cumulative CPU seconds, commands and throttled periods, to subtract later."""
        cpu = cpu_seconds(self.pid)
        info: dict[str, Any] = self.client().info("commandstats")
        by = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k != "cmdstat_cluster"}
        periods = throttled = 0
        if self.cgroup is not None and (self.cgroup / "cpu.stat").exists():
            stat = dict(ln.split() for ln in (self.cgroup / "cpu.stat").read_text().splitlines() if ln)
            periods, throttled = int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))
        return {"cpu_s": cpu, "calls": sum(by.values()), "periods": periods, "throttled": throttled, "by": by}

    def memory(self) -> int:
        return int(self.client().info("memory")["used_memory"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()


@dataclass
class Deployment:
    """The redis-servers of one configuration: one instance, or a cluster of masters."""

    nodes: list[Node] = field(default_factory=list)
    capped: bool = False

    @property
    def url(self) -> str:
        if len(self.nodes) == 1 and not self.nodes[0].cluster:
            return f"redis://127.0.0.1:{self.nodes[0].port}/0"
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def slot_owners(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, node index) of every slot range (cluster only)."""
        ports = {n.port: i for i, n in enumerate(self.nodes)}
        rows = self.nodes[0].client().execute_command("CLUSTER", "SLOTS")
        return [(int(r[0]), int(r[1]), ports[int(r[2][1])]) for r in rows]

    def sample(self) -> list[dict[str, Any]]:
        return [n.sample() for n in self.nodes]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def start(ports: list[int], workdir: Path, cluster: bool, cores: float | None, tag: str) -> Deployment:
    """Start the servers (a cluster when `cluster`), each capped at `cores` when given."""
    dep = Deployment([Node(p, workdir / f"redis-{p}", cluster) for p in ports])
    try:
        for n in dep.nodes:
            n.start()
        if cluster:
            _create_cluster(dep)
        if cores:
            dep.capped = all(n.cap(cores, f"wsllm-scale-{tag}-{n.port}") for n in dep.nodes)
    except BaseException:
        dep.stop()
        raise
    return dep


def _create_cluster(dep: Deployment) -> None:
    addrs = [f"127.0.0.1:{n.port}" for n in dep.nodes]
    cmd = ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in dep.nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not reach cluster_state:ok")
        time.sleep(0.1)


def names_per_shard(dep: Deployment, per_shard: int, prefix: str = "fake") -> list[str]:
    """Model names whose hash tag puts `per_shard` of them on each master, interleaved
    by shard, so that spreading streams over the names spreads them over the shards."""
    from redis.crc import key_slot

    if len(dep.nodes) == 1 and not dep.nodes[0].cluster:
        return [f"{prefix}-{i}" for i in range(per_shard)]
    owners = dep.slot_owners()
    buckets: list[list[str]] = [[] for _ in dep.nodes]
    i = 0
    while min(len(b) for b in buckets) < per_shard:
        name = f"{prefix}-{i}"
        slot = key_slot(f"{{{name}}}".encode())
        shard = next(idx for lo, hi, idx in owners if lo <= slot <= hi)
        if len(buckets[shard]) < per_shard:
            buckets[shard].append(name)
        i += 1
    return [b[k] for k in range(per_shard) for b in buckets]
