"""Resident memory of a server and every process it started (vLLM's engine core is a
child), read from /proc: what `ps` would show, summed over the tree.

Run as a script, it says where a process's resident memory is:

    python bench/procmem.py --pid PID      # by mapping: heap, anonymous, each file (smaps)
    python bench/procmem.py --stages       # what each piece of `wsllm serve` adds, loaded
                                           # in this process one after another, then one request
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import threading
from collections import Counter
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name may hold spaces and parentheses: ppid follows the last ')'
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _status_kb(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def tree_rss_mb(pid: int) -> float:
    """Resident memory now (VmRSS) of `pid` and its descendants, in MB."""
    return sum(_status_kb(p, "VmRSS") for p in tree(pid)) / 1024


def tree_hwm_mb(pid: int) -> float:
    """The sum of each live process's own peak (VmHWM), in MB: the peak of a one-process
    server; an upper bound for several."""
    return sum(_status_kb(p, "VmHWM") for p in tree(pid)) / 1024


class PeakSampler:
    """Samples a process tree's resident memory on a thread; `peak_mb` is the highest sum
    seen (a tree whose processes peak at different times is not over-counted)."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s, self.peak_mb = pid, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not os.path.exists(f"/proc/{self.pid}"):
                return
            self.peak_mb = max(self.peak_mb, tree_rss_mb(self.pid))


def by_mapping(pid: int | str, key: str = "Rss") -> Counter[str]:
    """kB of `key` (Rss, Anonymous, ...) per mapping name ("[heap]", "[anon]", a file)."""
    kb: Counter[str] = Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(None, 5)
            name = parts[5].strip() if len(parts) > 5 else "[anon]"
        elif line.startswith(key + ":"):
            kb[name] += int(line.split()[1])
    return kb


def rollup_mb(pid: int | str = "self") -> dict[str, float]:
    """/proc/PID/smaps_rollup in MB: Rss, Anonymous, Shared_Clean, Private_Dirty, ..."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) / 1024
    return out


def print_mappings(pid: int, top: int = 12) -> None:
    r = rollup_mb(pid)
    print(f"pid {pid}: resident {r['Rss']:.0f} MB: anonymous {r['Anonymous']:.0f}, file-backed "
          f"{r['Rss'] - r['Anonymous']:.0f}")  # fmt: skip
    rss, anon = by_mapping(pid), by_mapping(pid, "Anonymous")
    for name, kb in rss.most_common(top):
        print(f"  {kb / 1024:8.1f} MB  (anonymous {anon[name] / 1024:6.1f})  {name}")


def stages(num_kv_blocks: int) -> None:
    """Load the pieces of `wsllm serve` (the default model) here, one after another, and
    print what each adds to this process's resident memory."""
    last = rollup_mb()

    def stage(name: str) -> None:
        nonlocal last
        now = rollup_mb()
        print(f"{name:44s} resident {now['Rss']:7.1f} MB (+{now['Rss'] - last['Rss']:6.1f}), "
              f"anonymous {now['Anonymous']:7.1f} (+{now['Anonymous'] - last['Anonymous']:6.1f})", flush=True)  # fmt: skip
        last = now

    stage("python")
    import torch  # noqa: F401

    stage("import torch")
    from wsllm.broker.memory import MemoryBroker
    from wsllm.config import EngineConfig
    from wsllm.config_gateway import GatewayConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.models.build import build_model
    from wsllm.models.loader import release_freed_heap
    from wsllm.server.app import create_app
    from wsllm.types import GenerateRequest, SamplingParams

    stage("import wsllm (engine, gateway, transformers)")
    cfg = EngineConfig(num_kv_blocks=num_kv_blocks)
    built = build_model(cfg)
    stage("the model (weights mapped, not yet read)")
    engine = LLMEngine(cfg, built.model, built.model_dir, built.name, built.eos_token_ids)
    stage(f"the engine: KV cache of {num_kv_blocks * cfg.block_size} tokens")
    dirs = {engine.model_name: engine.model_dir}
    create_app(GatewayConfig(), MemoryBroker(), engine.model_dir, engine.model_name, tokenizer_dirs=dirs)
    stage("the gateway (its tokenizer)")
    release_freed_heap()
    stage("release_freed_heap")
    engine.add_request(
        GenerateRequest("one", list(range(100, 140)), SamplingParams(max_tokens=24, temperature=0.0))
    )
    while engine.has_unfinished():
        engine.step()
    stage("one request (40 prompt tokens, 24 out)")
    engine.add_request(
        GenerateRequest(
            "s", list(range(100, 140)), SamplingParams(max_tokens=8, structured={"regex": "[a-z]+"})
        )
    )
    while engine.has_unfinished():
        engine.step()
    stage("one structured request (llguidance's index)")
    print_mappings(os.getpid())  # while the engine is alive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, help="break down this process's resident memory")
    p.add_argument("--stages", action="store_true", help="what each piece of wsllm serve adds")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="--stages: KV blocks of 16 tokens")
    args = p.parse_args()
    if args.pid:
        print_mappings(args.pid)
    if args.stages:
        stages(args.num_kv_blocks)


if __name__ == "__main__":
    main()
