"""The loop between a broker and an engine. No asyncio: in memory mode it runs in its
own thread, in a deployment it is the engine process's main loop.

One iteration:
  1. pull as many requests as the engine can admit now (`free_capacity()`) and hand
     them to the intake (intake.py: checked, added, or each its own error event);
  2. apply aborts (after the adds: one that raced a pull still lands) and adapter commands;
  3. step the engine and publish one batch of TokenEvents for the whole step.

`drain_gracefully()` (SIGTERM in `wsllm engine`) stops pulling, lets the engine finish
what it holds for a while, then hands the rest back to the broker for another engine
(`BrokerSide.release`); what the broker cannot take back ends with `worker_lost`.
The engine and the broker side it uses are Protocols (worker_contract.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

from wsllm.engine.commands import apply_commands, held_adapters
from wsllm.engine.intake import Intake
from wsllm.engine.live import LiveRequests
from wsllm.engine.worker_contract import BrokerSide, Engine
from wsllm.types import ERR_ENGINE_STALLED, ERR_INTERNAL, ERR_WORKER_LOST, EngineInfo, TokenEvent

log = logging.getLogger(__name__)

#: what `busy()` says of an engine step
STEP = "one step"
#: the steps whose longest is what a step of this engine takes (`expected_s`)
STEP_TIMES = 16


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        broker: BrokerSide,
        *,
        engine_id: str | None = None,
        idle_wait_s: float = 0.05,
        heartbeat_s: float = 0.5,
        aliases: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.aliases = list(aliases or [])
        self.broker = broker
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.idle_wait_s = idle_wait_s
        self.heartbeat_s = heartbeat_s
        self.steps = 0  # engine steps taken; tests wait on it instead of sleeping
        self._live = LiveRequests()
        self._intake = Intake(engine, broker, self._live)
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._drain_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._stepped = threading.Condition()
        self._last_heartbeat = 0.0
        self._last_info: EngineInfo | None = None
        # what the engine is doing now, since when (time.monotonic()): the watchdog's reading
        self._busy: tuple[float, str] | None = None
        self._step_s: deque[float] = deque(maxlen=STEP_TIMES)  # the last steps' seconds
        self._gate = threading.Lock()  # a step's publish, or a watchdog's give_up: one at a time
        self.stalled: str | None = None  # why the watchdog gave up on this engine
        self._prefix_at = 0.0  # when the cached prefix blocks were last published
        self._prefix_sig: tuple[int, bytes, bytes] = (0, b"", b"")
        #: called with each published batch (tests, metrics); runs on the worker thread
        self.on_publish: Callable[[list[TokenEvent]], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Run the loop in a daemon thread (memory mode). An engine built on another
        thread runs slower on the CPU: see `spawn`."""
        if self._thread is not None:
            raise RuntimeError("the worker is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=f"wsllm-{self.engine_id}", daemon=True)
        self._thread.start()
        return self._thread

    @classmethod
    def spawn(cls, build: Callable[[], Engine], broker: BrokerSide, **kwargs: Any) -> EngineWorker:
        """Build the engine and run its loop on one new daemon thread; returns once the
        engine is built, raising what `build` raised.

        On the CPU the engine must run on the thread that loaded it. GNU OpenMP keeps a
        thread pool per calling thread; a model loaded on the main thread and run on
        another leaves two pools, more OpenMP threads than cores, and libgomp then stops
        spinning at its barriers and sleeps on a futex instead: every parallel op pays a
        wake-up. Measured with the default model at batch 1 on 2 cores: 51 ms per step
        on the loading thread, 79-95 ms on another (docs/benchmarks.md)."""
        built = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            try:
                worker = box["worker"] = cls(build(), broker, **kwargs)
                worker._thread = threading.current_thread()
            except BaseException as e:
                box["error"] = e
                return
            finally:
                built.set()
            worker.run()

        threading.Thread(target=main, name="wsllm-engine", daemon=True).start()
        built.wait()
        if "error" in box:
            raise box["error"]
        worker: EngineWorker = box["worker"]
        return worker

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop, aborting what the engine still holds, and leave the engine empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"worker {self.engine_id} did not stop within {timeout}s")
            self._thread = None

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def drain_gracefully(self, timeout: float) -> None:
        """Stop pulling; `run()` returns once the engine is empty, or after `timeout`
        seconds, handing what is left back to the broker. Safe from a signal handler."""
        self._drain_deadline = time.monotonic() + timeout
        self._draining.set()

    def run(self) -> None:
        log.info("worker %s serving %s", self.engine_id, self.engine.model_name)
        try:
            while not self._stop.is_set():
                if self._draining.is_set() and (
                    not self.engine.has_unfinished() or time.monotonic() >= self._drain_deadline
                ):
                    break
                self.run_once()
        finally:
            self.drain()
            self.broker.deregister(self.engine_id)

    def wait_steps(self, n: int, timeout: float = 30.0) -> int:
        """Block until the engine has taken `n` more steps; returns the step count.
        Tests wait on this instead of sleeping."""
        with self._stepped:
            target = self.steps + n
            if not self._stepped.wait_for(lambda: self.steps >= target, timeout):
                raise TimeoutError(f"the engine took {self.steps - target + n} of {n} steps in {timeout}s")
            return self.steps

    # -- one iteration -------------------------------------------------------------------

    def run_once(self) -> int:
        """Pull, abort, step, publish. Returns the number of events published."""
        busy = self.engine.has_unfinished()
        room = 0 if self._draining.is_set() else self.engine.free_capacity()
        rank = None
        if room > 0:  # a broker that can choose takes the engine's order: priority, then fairness
            ranker = self.engine.admission_rank()
            rank = lambda r: ranker(r.priority, r.tenant)  # noqa: E731
        pulled = self.broker.pull(room, 0.0 if busy else self.idle_wait_s, rank=rank)
        # The engine's work is timed for the watchdog, the broker's calls are not (a Redis
        # outage is not a stall: the leases and the orphan deadline cover it).
        with self._working("adding requests"):
            events = self._intake.admit(pulled)
        aborts = self.broker.aborts()
        with self._working("applying aborts"):
            self._apply_aborts(aborts)
        with self._working("applying adapter commands"):
            apply_commands(self.engine, self.broker, self.engine_id, self._heartbeat)
        if self._given_up():
            return 0
        if self.engine.has_unfinished():
            events += self._step()
        self._maybe_publish_prefix(any(e.finish_reason for e in events))  # before the answers end
        if events:
            self.broker.publish(events)
            if self.on_publish is not None:
                self.on_publish(events)
        self._maybe_heartbeat()
        return len(events)

    def _apply_aborts(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if not isinstance(rid, str):  # a broker bug, not a reason to stop serving
                log.error("ignoring an abort that is not a request id: %r", rid)
                continue
            try:
                self.engine.abort(rid)  # False when it finished already: nothing to free
            except Exception:
                log.exception("aborting %s failed", rid)

    @contextlib.contextmanager
    def _working(self, what: str) -> Iterator[None]:
        self._busy = (time.monotonic(), what)
        try:
            yield
        finally:
            self._busy = None

    def _step(self) -> list[TokenEvent]:
        started = time.monotonic()
        self._busy = (started, STEP)
        try:
            if self._intake.holds_step():  # test only (intake.HOLD_STEP_ENV): a request of death
                self._stop.wait()
            outputs = self.engine.step()
        except Exception:  # keep serving: fail what the engine held, not the process
            log.exception("engine step failed; failing %d requests", len(self._live))
            return self._fail_all(ERR_INTERNAL, "the engine failed while serving this request")
        finally:
            self._busy = None
        if self._given_up():
            return []
        self._step_s.append(time.monotonic() - started)
        with self._stepped:
            self.steps += 1
            self._stepped.notify_all()
        events: list[TokenEvent] = []
        for out in outputs:
            events.extend(self._live.events_of(out))
        return events

    def _given_up(self) -> bool:
        """The watchdog gave up on the engine meanwhile: its requests are elsewhere now;
        what the engine still holds is dropped and the loop ends."""
        with self._gate:
            if self.stalled is None:
                return False
            for rid in self._live.ids():
                self.engine.abort(rid)
                self._live.drop(rid)
            self._stop.set()
            return True

    def _fail_all(self, code: str, message: str) -> list[TokenEvent]:
        events = []
        for rid in self._live.ids():
            self.engine.abort(rid)
            events.append(self._live.failure(rid, code, message))
        return events

    def drain(self) -> None:
        """Hand what the engine still holds back to the broker (or fail it with
        worker_lost when the broker cannot take it), then step until the engine holds
        nothing (blocks freed)."""
        if self._live:
            kept = set(self.broker.release(self._live.ids()))
            for rid in [r for r in self._live if r not in kept]:
                self.engine.abort(rid)
                self._live.drop(rid)
        events = self._fail_all(ERR_WORKER_LOST, "the engine worker stopped")
        for _ in range(1000):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        if events:
            self.broker.publish(events)

    def _maybe_heartbeat(self) -> None:
        if time.monotonic() - self._last_heartbeat >= self.heartbeat_s:
            self._heartbeat()

    def _heartbeat(self) -> None:  # also after adapter commands: give_up's last word repeats it
        self._last_heartbeat, self._last_info = time.monotonic(), self.info()
        self.broker.heartbeat(self._last_info)

    # -- the watchdog (watchdog.py), from its own thread ---------------------------------

    def busy(self) -> tuple[float, str] | None:
        """(since when, what): the engine's work in progress (`STEP`, or adding requests,
        applying aborts or adapter commands); None while the worker waits on its broker."""
        return self._busy

    def expected_s(self) -> float:
        """What a step of this engine takes, by its last `STEP_TIMES` steps: the longest
        (a long prompt's next chunk costs about what its last one did); 0 before any."""
        return max(self._step_s, default=0.0)

    def keepalive(self) -> None:
        """From the watchdog's thread while the engine is busy and not given up on: its
        last heartbeat again, when one is due (a Redis engine's leases are refreshed with
        it), so that a long step does not pass for a dead engine whose requests another
        engine reclaims; whether the engine is stuck is the watchdog's to say, and only a
        process that died loses its leases."""
        if self._busy is None or time.monotonic() - self._last_heartbeat < self.heartbeat_s:
            return
        with self._gate:
            if self.stalled is None:
                self._last_heartbeat = time.monotonic()
                self.broker.heartbeat(self._last_info or self._first_info())

    def _first_info(self) -> EngineInfo:
        """What a worker stuck in its first iteration says of itself (its engine's stats
        cannot be read from another thread while it works)."""
        return EngineInfo(
            self.engine_id, self.engine.model_name, self.engine.max_model_len, aliases=self.aliases
        )

    def give_up(self, reason: str) -> None:
        """The engine is stuck: hand its requests back to the broker, marked as held by a
        stalled engine (another engine takes them; one it had already handed on after a
        stall stays, `BrokerSide.release`), end those that stay with `engine_stalled`, and
        heartbeat once more with `stats["stalled"]` (the gateway's /health reads it).
        Called from the watchdog's thread while this worker's is stuck in the engine;
        if the engine ever returns, its results are dropped and the loop ends."""
        with self._gate:
            self.stalled = reason
            ids = self._live.ids()
            stays = set(self.broker.release(ids, stalled=True)) if ids else set()  # not handed on
            events = [
                self._live.failure(rid, ERR_ENGINE_STALLED, _stalled(rid, reason))
                for rid in ids
                if rid in stays
            ]
            if events:
                self.broker.publish(events)
            last = self._last_info or self._first_info()
            self.broker.heartbeat(replace(last, stats=last.stats | {"stalled": reason}))
            handed, ended = [rid for rid in ids if rid not in stays], sorted(stays)
            log.critical("%s: handed back %s, ended %s", reason, handed[:16], ended[:16])

    def _maybe_publish_prefix(self, finished: bool) -> None:
        """Tell a broker that routes by prefix (`publish_prefix`) which prefix blocks this
        engine caches: when they changed and a request ended (its conversation's next
        turn may come at once) or a heartbeat is due, and at least once per heartbeat."""
        now = time.monotonic()
        if not self.broker.routes_by_prefix() or not (finished or now - self._prefix_at >= self.heartbeat_s):
            return
        block_size, keys = self.engine.cached_prefix()
        sig = (len(keys), keys[0] if keys else b"", keys[-1] if keys else b"")
        if sig == self._prefix_sig and now - self._prefix_at < self.heartbeat_s:
            return
        self._prefix_sig, self._prefix_at = sig, now
        self.broker.publish_prefix(block_size, keys)

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(
            engine_id=self.engine_id, model=e.model_name, max_model_len=e.max_model_len, aliases=self.aliases,
            adapters=held_adapters(e), stats=asdict(e.stats()),
        )  # fmt: skip


def _stalled(request_id: str, reason: str) -> str:
    return (
        f"the engine stopped making progress: {reason}; request {request_id} is not handed to another "
        "engine (a request held by a stalled engine is handed to another engine at most once)"
    )
