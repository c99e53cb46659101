"""The programs a client hands the gateway, run on bounded, low-priority pools that
take tenants in turn: chat templates (`render`: jinja2 in a sandbox, but loops are
allowed) on `template_threads` threads, structured-output checks (`check`: llguidance's
compile, Rust code that no signal stops) in `spec_check_workers` processes.

- **Bounded**: a flood of templates or unique schemas waits in a queue; it never gets
  a thread per request (each template used to get a thread of its own, with no limit).
- **Low priority**: the threads are niced by `text_work_nice` (Linux keeps a nice value
  per thread), the processes too: the engine's threads take the cores first.
- **Fair**: the queue is one line per tenant, taken in turn (`FairJobs`): a tenant that
  sends a hundred templates delays another's one by one template, not by a hundred.
- **Deadlines that free the worker**: a job waits and runs within its deadline. A
  template past it is interrupted (an exception raised in its thread at its next
  Python bytecode, which jinja2's compiled loops reach at every iteration) and its
  thread takes the next job; a check past it has its process killed, and a fresh one
  is started for the next job. A job whose deadline passed while it waited is dropped.

`configure` (from `create_app`) sets the sizes; the pools start on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from wsllm.priority import lower_priority

log = logging.getLogger(__name__)

T = TypeVar("T")


class Interrupted(BaseException):
    """Raised in a template thread past its deadline (never caught by `except Exception`)."""


@dataclass(slots=True)
class Job:
    """One program to run: `work()` in a thread, or `arg` in a process's `target`."""

    tenant: str
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]
    work: Callable[[], Any] | None = None
    arg: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: int | None = None  # the native id of the thread running it, while it runs

    def settle(self, ok: bool, value: Any) -> None:
        """Resolve the awaiting future from any thread (once)."""

        def set_it() -> None:
            if not self.done.done():
                (self.done.set_result if ok else self.done.set_exception)(value)

        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.loop.call_soon_threadsafe(set_it)


class FairJobs:
    """A queue of jobs, one line per tenant, taken in turn; thread-safe."""

    def __init__(self) -> None:
        self._lines: OrderedDict[str, deque[Job]] = OrderedDict()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return sum(len(line) for line in self._lines.values())

    def put(self, job: Job) -> None:
        with self._cond:
            self._lines.setdefault(job.tenant, deque()).append(job)
            self._cond.notify()

    def take(self) -> Job:
        """The next tenant's first job (blocks while there is none)."""
        with self._cond:
            while not self._lines:
                self._cond.wait()
            tenant, line = next(iter(self._lines.items()))
            job = line.popleft()
            del self._lines[tenant]
            if line:  # its next job waits behind every other tenant's
                self._lines[tenant] = line
            return job


def _interrupt(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(Interrupted))


class ThreadPool:
    """`size` niced threads running jobs' `work()`, interrupted past their deadline."""

    def __init__(self, size: int, nice: int, name: str) -> None:
        self.jobs = FairJobs()
        self.size, self.nice, self.name = size, nice, name
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(size)
        ]
        for t in self._threads:
            t.start()

    async def run(self, work: Callable[[], T], limit_s: float, tenant: str) -> T:
        """`work()` on the pool within `limit_s` seconds of waiting and running;
        TimeoutError past it (the job is dropped, or interrupted where it runs)."""
        loop = asyncio.get_running_loop()
        job = Job(tenant, time.monotonic() + limit_s, loop, loop.create_future(), work=work)
        job.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late outcome: nobody's
        self.jobs.put(job)
        try:
            result: T = await asyncio.wait_for(asyncio.shield(job.done), limit_s)
            return result
        except (TimeoutError, asyncio.CancelledError):
            self._stop(job)  # the client left, or the deadline passed: its work stops too
            raise

    @staticmethod
    def _stop(job: Job) -> None:
        with job.lock:
            job.deadline = 0.0  # not started: never will be
            if job.thread is not None:
                _interrupt(job.thread)

    def _serve(self) -> None:
        lower_priority(self.nice, f"the gateway's {self.name} pool")
        while True:
            try:
                self._run(self.jobs.take())
            except Interrupted:  # arrived as its job ended: the thread goes on
                continue

    def _run(self, job: Job) -> None:
        with job.lock:
            if time.monotonic() >= job.deadline or job.work is None:
                return  # it waited past its deadline: its caller has given up
            job.thread = threading.get_ident()
        try:
            value, ok = job.work(), True
        except Interrupted:
            log.warning("a %s job ran past its deadline and was interrupted", self.name)
            value, ok = TimeoutError(), False
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            value, ok = e, False
        finally:
            with job.lock:
                job.thread = None
        job.settle(ok, value)


def _child(conn: Any, target: Callable[[Any], Any], nice: int) -> None:
    """A check process: run `target` on what comes, send back its result or error."""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    while True:
        try:
            arg = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, target(arg)))
        except Exception as e:  # noqa: BLE001 - its message is the check's answer
            conn.send((False, (type(e).__name__, str(e))))


class ProcessPool:
    """`size` niced processes running `target(job.arg)`; a job past its deadline has
    its process killed, and the next job gets a fresh one."""

    def __init__(self, size: int, nice: int, target: Callable[[Any], Any], name: str) -> None:
        self.jobs = FairJobs()
        self.nice, self.target, self.name = nice, target, name
        self.pids: list[int | None] = [None] * size  # each slot's live process (tests)
        self.killed = 0
        self._ctx = multiprocessing.get_context("spawn")  # never fork a threaded server
        for i in range(size):
            threading.Thread(target=self._slot, args=(i,), name=f"{name}-{i}", daemon=True).start()

    async def run(self, arg: Any, limit_s: float, tenant: str) -> Any:
        """`target(arg)` in a process within `limit_s` seconds of waiting and running;
        TimeoutError past it. An exception the target raised comes back as a
        ValueError with its message."""
        loop = asyncio.get_running_loop()
        job = Job(tenant, time.monotonic() + limit_s, loop, loop.create_future(), arg=arg)
        job.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.jobs.put(job)
        try:
            return await asyncio.wait_for(asyncio.shield(job.done), limit_s)
        except (TimeoutError, asyncio.CancelledError):
            job.deadline = 0.0  # its slot kills the process at once, or never starts it
            raise

    def _start(self) -> tuple[Any, Any]:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child, args=(child, self.target, self.nice), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def _slot(self, i: int) -> None:
        proc: Any = None
        conn: Any = None
        while True:
            job = self.jobs.take()
            if time.monotonic() >= job.deadline:
                continue
            try:
                if proc is None or not proc.is_alive():
                    proc, conn = self._start()
                    self.pids[i] = proc.pid
                conn.send(job.arg)
                while not conn.poll(min(0.05, max(0.0, job.deadline - time.monotonic()))):
                    if time.monotonic() >= job.deadline or not proc.is_alive():
                        raise TimeoutError
                ok, value = conn.recv()
            except (TimeoutError, EOFError, OSError) as e:
                self._kill(i, proc, conn)
                job.settle(False, TimeoutError() if isinstance(e, TimeoutError) else OSError(str(e)))
                proc, conn = self._start()  # the next job's, starting while none waits
                self.pids[i] = proc.pid
                continue
            job.settle(True, value) if ok else job.settle(False, ValueError(value[1]))

    def _kill(self, i: int, proc: Any, conn: Any) -> None:
        """A job ran past its deadline (or its process died): that process goes."""
        if proc is not None and proc.is_alive():
            proc.kill()
            self.killed += 1
            log.warning("a %s job ran past its deadline: its process was killed", self.name)
        if proc is not None:
            proc.join(5)
        if conn is not None:
            conn.close()
        self.pids[i] = None


_settings: tuple[int, int, int] = (2, 1, 10)  # (template threads, check processes, nice)
_templates: ThreadPool | None = None
_checks: ProcessPool | None = None
_lock = threading.Lock()


def configure(template_threads: int, check_workers: int, nice: int) -> None:
    """The pools' sizes and CPU priority (GatewayConfig's); a change takes effect for the
    pools started after it (they start on first use)."""
    global _settings, _templates, _checks
    if template_threads < 1 or check_workers < 1 or nice < 0:
        raise ValueError("the programs' pools need sizes >= 1 and nice >= 0")
    with _lock:
        if (template_threads, check_workers, nice) != _settings:
            _settings, _templates, _checks = (template_threads, check_workers, nice), None, None


def templates() -> ThreadPool:
    global _templates
    with _lock:
        if _templates is None:
            _templates = ThreadPool(_settings[0], _settings[2], "wsllm-template")
        return _templates


def checks() -> ProcessPool:
    global _checks
    from wsllm.structured import check_spec  # the child imports it too: llguidance, no torch

    with _lock:
        if _checks is None:
            _checks = ProcessPool(_settings[1], _settings[2], check_spec, "wsllm-spec-check")
        return _checks


async def render(work: Callable[[], T], limit_s: float, tenant: str) -> T:
    """A chat template's `work()` (with its tokenization) on the template pool."""
    return await templates().run(work, limit_s, tenant)


async def check(spec: Any, limit_s: float, tenant: str) -> float:
    """Check a structured-output spec in the check pool within `limit_s` seconds of
    waiting and compiling: ValueError for one that does not compile, or not in time.
    Returns the seconds it took, for the tenant's charge."""
    t0 = time.monotonic()
    try:
        await checks().run(spec, limit_s, tenant)
    except TimeoutError:
        raise ValueError(f"structured.{next(iter(spec))}: did not compile within {limit_s:g}s") from None
    return time.monotonic() - t0
