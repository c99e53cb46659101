"""Resident memory of a server and every process it started (vLLM's engine core is a
child), read from /proc: what `ps` would show, summed over the tree."""

from __future__ import annotations

import contextlib
import os
import threading
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
