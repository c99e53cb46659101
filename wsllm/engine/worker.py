"""The loop between a broker and an engine. No asyncio: in memory mode it runs in its
own thread, in a deployment it is the engine process's main loop.

One iteration:
  1. pull as many requests as the engine can admit now (`free_capacity()`), check each
     against the wire schema (`wire.check_request`; what fails goes to the broker's
     dead letters) and add it; a request the engine refuses, or that fails while it
     is added, becomes an error event for that request only, never a crash;
  2. apply aborts (after the adds: one that raced a pull still lands) and adapter commands;
  3. step the engine and publish one batch of TokenEvents for the whole step.

`drain_gracefully()` (SIGTERM in `wsllm engine`) stops pulling, lets the engine finish
what it holds for a while, then hands the rest back to the broker for another engine
(`BrokerSide.release`); what the broker cannot take back ends with `worker_lost`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, Protocol

from wsllm.engine.commands import apply_commands, held_adapters
from wsllm.engine.live import LiveRequests
from wsllm.engine.outputs import EngineStats, RequestOutput
from wsllm.types import (
    ERR_ENGINE_BUSY,
    ERR_ENGINE_STALLED,
    ERR_INTERNAL,
    ERR_INVALID_REQUEST,
    ERR_QUEUE_TIMEOUT,
    ERR_WORKER_LOST,
    AdapterCommand,
    AdapterReply,
    EngineBusy,
    EngineInfo,
    GenerateRequest,
    TokenEvent,
    WireError,
)
from wsllm.wire import check_request

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The part of LLMEngine the worker uses."""

    model_name: str
    max_model_len: int
    adapters: Any  # its LoRA adapters (commands.AdapterRegistry); None where it serves none

    def add_request(self, request: GenerateRequest) -> None: ...
    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def free_capacity(self) -> int: ...
    def stats(self) -> EngineStats: ...
    def cached_prefix(self) -> tuple[int, list[bytes]]: ...


class BrokerSide(Protocol):
    """The engine's side of a broker, as this worker uses it. The broker package
    declares the same calls (`broker.base.EngineBroker`, whose docstrings say what
    each promises); every broker satisfies this Protocol without the engine importing
    the broker (tests/unit/test_broker_contract.py checks it)."""

    def pull(
        self, max_n: int, timeout: float = 0.0, rank: Callable[[GenerateRequest], Any] | None = None
    ) -> list[GenerateRequest]: ...
    def aborts(self) -> list[str]: ...
    def publish(self, events: list[TokenEvent]) -> None: ...
    def heartbeat(self, info: EngineInfo) -> None: ...
    def deregister(self, engine_id: str) -> None: ...
    def dead_letter(self, item: object, reason: str) -> None: ...
    def release(self, request_ids: list[str]) -> list[str]: ...
    def commands(self) -> list[AdapterCommand]: ...
    def reply(self, reply: AdapterReply) -> None: ...
    def routes_by_prefix(self) -> bool: ...
    def publish_prefix(self, block_size: int, keys: list[bytes]) -> None: ...


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
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._drain_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._stepped = threading.Condition()
        self._last_heartbeat = 0.0
        self._last_info: EngineInfo | None = None
        self._step_since: float | None = None  # time.monotonic() the step in progress began
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
        events = self._admit(self.broker.pull(room, 0.0 if busy else self.idle_wait_s, rank=rank))
        self._apply_aborts(self.broker.aborts())
        apply_commands(self.engine, self.broker, self.engine_id, self._heartbeat)
        if self.engine.has_unfinished():
            events += self._step()
        self._maybe_publish_prefix(any(e.finish_reason for e in events))  # before the answers end
        if events:
            self.broker.publish(events)
            if self.on_publish is not None:
                self.on_publish(events)
        self._maybe_heartbeat()
        return len(events)

    def _admit(self, requests: list[GenerateRequest]) -> list[TokenEvent]:
        errors: list[TokenEvent] = []
        for r in requests:
            try:
                r = check_request(r)
            except WireError as e:  # nobody can serve it; fail it if it names a request
                self.broker.dead_letter(r, f"invalid request: {e}")
                rid = getattr(r, "request_id", None)
                if isinstance(rid, str) and rid and rid not in self._live:
                    errors.append(_error_event(rid, ERR_INVALID_REQUEST, f"the engine cannot serve it: {e}"))
                continue
            if r.expired(time.time()):  # it waited in the broker past its deadline
                errors.append(
                    _error_event(r.request_id, ERR_QUEUE_TIMEOUT, "no engine took this request in time")
                )
                continue
            error = self._add(r)
            if error is None:
                self._live.add(r.request_id)
            else:
                errors.append(error)
        return errors

    def _add(self, r: GenerateRequest) -> TokenEvent | None:
        """Add one request to the engine; its error event when that failed. Whatever
        goes wrong costs this request only: the engine is left without it."""
        if r.request_id in self._live:  # delivered twice: the first copy runs
            log.warning("request %s is already running here", r.request_id)
            return None
        try:
            # The gateway's arrival time: queue time then counts the broker's queue too.
            self.engine.add_request(r)
        except EngineBusy as e:
            return _error_event(r.request_id, ERR_ENGINE_BUSY, str(e))
        except ValueError as e:
            return _error_event(r.request_id, ERR_INVALID_REQUEST, str(e))
        except Exception:
            log.exception("adding request %s failed; failing it alone", r.request_id)
            try:
                self.engine.abort(r.request_id)
            except Exception:
                log.exception("and aborting it failed too")
            return _error_event(r.request_id, ERR_INTERNAL, "the engine failed while admitting this request")
        return None

    def _apply_aborts(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if not isinstance(rid, str):  # a broker bug, not a reason to stop serving
                log.error("ignoring an abort that is not a request id: %r", rid)
                continue
            try:
                self.engine.abort(rid)  # False when it finished already: nothing to free
            except Exception:
                log.exception("aborting %s failed", rid)

    def _step(self) -> list[TokenEvent]:
        self._step_since = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception:  # keep serving: fail what the engine held, not the process
            log.exception("engine step failed; failing %d requests", len(self._live))
            return self._fail_all(ERR_INTERNAL, "the engine failed while serving this request")
        finally:
            self._step_since = None
        with self._gate:
            if self.stalled is not None:  # given up on meanwhile: its requests are elsewhere now
                for rid in self._live.ids():
                    self.engine.abort(rid)
                    self._live.drop(rid)
                self._stop.set()
                return []
        with self._stepped:
            self.steps += 1
            self._stepped.notify_all()
        events: list[TokenEvent] = []
        for out in outputs:
            events.extend(self._live.events_of(out))
        return events

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

    def step_started(self) -> float | None:
        """When the step in progress began (time.monotonic()); None between steps."""
        return self._step_since

    def give_up(self, reason: str) -> None:
        """The engine is stuck in a step: hand its requests back to the broker (another
        engine takes them), end those it cannot take back with `engine_stalled`, and
        heartbeat once more with `stats["stalled"]` (the gateway's /health reads it).
        Called from the watchdog's thread while this worker's is stuck in the engine;
        if the step ever returns, its results are dropped and the loop ends."""
        with self._gate:
            self.stalled = reason
            ids = self._live.ids()
            stays = set(self.broker.release(ids)) if ids else set()  # what could not go back
            message = f"the engine stopped making progress: {reason}"
            events = [self._live.failure(rid, ERR_ENGINE_STALLED, message) for rid in ids if rid in stays]
            if events:
                self.broker.publish(events)
            last = self._last_info or EngineInfo(
                self.engine_id, self.engine.model_name, self.engine.max_model_len
            )
            self.broker.heartbeat(replace(last, stats=last.stats | {"stalled": reason}))
            log.critical("%s: %d requests handed back, %d ended", reason, len(ids) - len(events), len(events))

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


def _error_event(request_id: str, code: str, message: str, seq: int = 0) -> TokenEvent:
    return TokenEvent.failure(request_id, code, message, seq=seq)
