"""The progress watchdog: an engine with work that completes no step within
`stall_timeout_s` is stuck (a kernel that never returns, a C call holding the GIL, a
loop in the scheduler), whatever its process and heartbeat thread still do. What users
of other servers meet most is such a server: alive, /health 200, nothing coming.

`Watchdog` looks at one worker from a thread of its own, every quarter of the timeout
(at most every second): the worker says since when it has been in a step
(`EngineWorker.step_started`). Past the timeout it asks the worker to give up
(`EngineWorker.give_up`: its requests go back to the broker's queue for another engine,
or, where the broker cannot take them back (in-process), end with `engine_stalled`;
its last heartbeat says why, which /health answers with a 503), then calls `on_stall`:
`wsllm engine` exits with `EXIT_STALLED` for its supervisor to restart it (the compose
file's restart policy); `wsllm serve` stops its server with that code. Torch-free."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

#: the exit status of an engine process that stalled
EXIT_STALLED = 3


class Watched(Protocol):
    """The part of EngineWorker the watchdog uses."""

    engine_id: str

    def step_started(self) -> float | None: ...
    def give_up(self, reason: str) -> None: ...


class Watchdog:
    def __init__(self, worker: Watched, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"a stall timeout must be > 0, got {timeout_s}")
        self.worker, self.timeout_s, self.on_stall = worker, timeout_s, on_stall
        self.fired: str | None = None  # the reason, once it gave up on the engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._watch, name="wsllm-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def check(self, now: float | None = None) -> str | None:
        """Why the engine is stuck now, or None."""
        since = self.worker.step_started()
        now = time.monotonic() if now is None else now
        if since is None or now - since <= self.timeout_s:
            return None
        return (
            f"engine {self.worker.engine_id} has been in one step for {now - since:.0f}s "
            f"(--stall-timeout-s {self.timeout_s:g})"
        )

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            reason = self.check()
            if reason is None:
                continue
            log.critical("%s: giving up on it", reason)
            self.fired = reason
            try:
                self.worker.give_up(reason)
            finally:
                self.on_stall(reason)
            return
