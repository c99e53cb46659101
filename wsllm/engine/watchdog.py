"""The progress watchdog: an engine whose work in progress (a step, or adding requests,
applying aborts or adapter commands between steps) runs past `stall_timeout_s` *and*
past what its steps take by a wide factor (`stall_factor` x the longest of its last
steps: `EngineWorker.expected_s`) is stuck (a kernel that never returns, a C call
holding the GIL, a loop in the scheduler, a request of death), whatever its process
and heartbeat thread still do. What users of other servers meet most is such a
server: alive, /health 200, nothing coming. Both bounds must pass: the timeout alone
would give up on a long prompt's legitimate chunks on a slow machine (an 8,000-token
prompt's steps of 3.5, 6.1, 9.1 and 10.6 s), the factor alone on an engine whose
steps are all short. An engine that has finished no step yet (it is warming up: its
first steps build kernels and caches, slowly on a loaded machine) has `stall_factor` x
`stall_timeout_s`. The broker's calls are not timed: an engine waiting on a Redis
outage is not stuck (the leases and the orphan deadline cover Redis).

`Watchdog` looks at one worker from a thread of its own, every quarter of the timeout
(at most every second): the worker says since when it has been busy and with what
(`EngineWorker.busy`). While it is busy and not stuck the watchdog sends its heartbeat
for it (`EngineWorker.keepalive`): a long step keeps the engine registered and its Redis
leases fresh, so its requests are not reclaimed by another engine (only a process that
died loses them), and a stuck engine's requests leave it through `give_up` alone,
marked. Once stuck it asks the worker to give up (`EngineWorker.give_up`:
its requests go back to the broker's queue for another engine, marked, each at most
once after a stall; what the broker cannot take back (in-process), or a request a
stalled engine had handed on before, ends with `engine_stalled`; its last heartbeat
says why, which /health answers with a 503), then calls `on_stall`: `wsllm engine`
exits with `EXIT_STALLED` for its supervisor to restart it (`wsllm serve --broker
redis://`, the compose file's restart policy); `wsllm serve` in memory stops its
server and exits with that code. Torch-free."""

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

    def busy(self) -> tuple[float, str] | None: ...
    def expected_s(self) -> float: ...
    def keepalive(self) -> None: ...
    def give_up(self, reason: str) -> None: ...


class Watchdog:
    def __init__(
        self,
        worker: Watched,
        timeout_s: float,
        on_stall: Callable[[str], None],
        factor: float,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"a stall timeout must be > 0, got {timeout_s}")
        if not factor >= 1:
            raise ValueError(f"a stall factor must be >= 1, got {factor}")
        self.worker, self.timeout_s, self.on_stall, self.factor = worker, timeout_s, on_stall, factor
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
        busy = self.worker.busy()
        if busy is None:
            return None
        since, what = busy
        took = (time.monotonic() if now is None else now) - since
        expected = self.worker.expected_s()
        # an engine that has finished no step yet is warming up (kernels, caches, a loaded
        # machine): its bound is the factor times the timeout
        bound = max(self.timeout_s, self.factor * expected) if expected > 0 else self.factor * self.timeout_s
        if took <= bound:
            return None
        doing = "in one step" if what == "one step" else what
        return (
            f"engine {self.worker.engine_id} has been {doing} for {took:.0f}s (--stall-timeout-s "
            f"{self.timeout_s:g}; its steps took up to {expected:.2f}s, --stall-factor {self.factor:g})"
        )

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            reason = self.check()
            if reason is None:
                self.worker.keepalive()  # busy, not stuck: its heartbeat (and leases) go on
                continue
            log.critical("%s: giving up on it", reason)
            self.fired = reason
            try:
                self.worker.give_up(reason)
            finally:
                self.on_stall(reason)
            return
