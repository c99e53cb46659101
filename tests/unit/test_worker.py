"""The engine worker between a memory broker and a real (tiny, random) engine, stepped
by hand with run_once() so that every assertion is about one iteration."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wsllm.broker.memory import MemoryBroker
from wsllm.config import EngineConfig
from wsllm.engine.worker import EngineWorker
from wsllm.types import GenerateRequest, SamplingParams, TokenEvent
from wsllm.wire import decode_events, encode


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:
    from wsllm.engine.engine import LLMEngine

    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=4, dtype="float32")
    )


@pytest.fixture
def rig(engine: Any) -> Iterator[tuple[EngineWorker, MemoryBroker, list[TokenEvent]]]:
    broker = MemoryBroker(max_queue_depth=64)
    worker = EngineWorker(engine, broker, idle_wait_s=0.0)
    published: list[TokenEvent] = []
    worker.on_publish = published.extend
    yield worker, broker, published
    worker.drain()
    broker.close()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def submit(broker: MemoryBroker, rid: str, prompt: list[int] | None = None, **params: Any) -> None:
    p = SamplingParams(**({"temperature": 0.0, "max_tokens": 4, "ignore_eos": True} | params))
    asyncio.run(broker.submit(GenerateRequest(rid, prompt or [5, 6, 7], p, arrival_time=time.time())))


def run_until_done(worker: EngineWorker, limit: int = 200) -> None:
    for _ in range(limit):
        worker.run_once()
        if not worker.engine.has_unfinished() and not asyncio.run(worker.broker.pending()):
            return
    raise AssertionError("the engine did not finish")


def test_events_have_seq_usage_and_queue_time(rig: Any) -> None:
    worker, broker, events = rig
    submit(broker, "a", max_tokens=5)
    submit(broker, "b", n=2, max_tokens=3, temperature=1.0, seed=1)
    run_until_done(worker)
    for rid, index, n_tokens in [("a", 0, 5), ("b", 0, 3), ("b", 1, 3)]:
        evs = [e for e in events if e.request_id == rid and e.index == index]
        assert [e.seq for e in evs] == list(range(len(evs)))
        assert sum(len(e.token_ids) for e in evs) == n_tokens
        assert [e.finish_reason for e in evs][-1] == "length" and all(
            e.finish_reason is None for e in evs[:-1]
        )
        assert evs[-1].usage is not None and evs[-1].usage.completion_tokens == n_tokens
        assert evs[-1].usage.prompt_tokens == 3
        assert evs[0].queue_time is not None and evs[0].queue_time >= 0
    # The broker saw the same events, one batch per step.
    assert worker.steps >= 5


def test_prompt_logprobs_ride_once_on_the_first_event_and_cross_the_wire(rig: Any) -> None:
    worker, broker, events = rig
    prompt = [5, 6, 7, 8, 9, 10, 11]
    submit(broker, "p", prompt=prompt, n=2, max_tokens=3, temperature=1.0, seed=2, prompt_logprobs=2)
    submit(broker, "q")
    run_until_done(worker)
    carrying = [e for e in events if e.prompt_logprobs is not None]
    assert [(e.request_id, e.index, e.seq) for e in carrying] == [("p", 0, 0)]
    plp = carrying[0].prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for tok, (lp, top) in zip(prompt[1:], plp[1:], strict=True):  # the prompt token, then the best 2
        best = dict(top)
        assert len(best) == 2 and 0 >= top[0][1] >= top[1][1]
        assert lp == best[tok] if tok in best else lp <= top[1][1]
    # the same bytes back: JSON makes the engine's tuples lists, and nothing else changes
    assert encode(decode_events(encode(carrying))) == encode(carrying)


def test_a_refused_request_becomes_an_error_event(rig: Any) -> None:
    worker, broker, events = rig
    submit(broker, "bad", prompt=[10**8])  # outside the vocabulary
    submit(broker, "good")
    run_until_done(worker)
    (err,) = [e for e in events if e.request_id == "bad"]
    assert (
        err.finish_reason == "error" and err.error_code == "invalid_request" and "prompt" in (err.error or "")
    )
    assert [e.finish_reason for e in events if e.request_id == "good"][-1] == "length"


def test_pull_only_what_the_engine_can_admit(rig: Any) -> None:
    worker, broker, _ = rig
    for i in range(10):
        submit(broker, f"r{i}", max_tokens=50)
    worker.run_once()
    assert asyncio.run(broker.pending()) == 10 - worker.engine.stats().num_running
    assert asyncio.run(broker.pending()) >= 6  # max_num_seqs is 4


def test_abort_of_a_running_request_frees_it_in_the_next_iteration(rig: Any) -> None:
    worker, broker, events = rig
    submit(broker, "long", max_tokens=100)
    worker.run_once()
    assert worker.engine.is_known("long")
    asyncio.run(broker.abort("long"))
    worker.run_once()
    assert not worker.engine.is_known("long")
    assert [e.finish_reason for e in events if e.request_id == "long"][-1] == "abort"


def test_abort_before_the_pull_never_reaches_the_engine(rig: Any) -> None:
    worker, broker, events = rig
    submit(broker, "gone")
    asyncio.run(broker.abort("gone"))
    worker.run_once()
    assert not worker.engine.is_known("gone") and not events


def test_the_thread_stops_cleanly_and_empties_the_engine(engine: Any) -> None:
    broker = MemoryBroker()
    worker = EngineWorker(engine, broker)
    worker.start()
    submit(broker, "x", max_tokens=1000)
    worker.wait_steps(2)
    assert asyncio.run(broker.engines())[0].stats["num_running"] in (0, 1)
    worker.stop()
    assert not engine.has_unfinished()
    assert asyncio.run(broker.engines()) == []  # deregistered

    async def last_event() -> TokenEvent:
        last = None
        async for batch in broker.events():
            last = batch[-1]
            if last.finish_reason:
                return last
        raise AssertionError("no final event")

    ev = asyncio.run(asyncio.wait_for(last_event(), 5))
    assert (ev.request_id, ev.finish_reason, ev.error_code) == ("x", "error", "worker_lost")
    broker.close()


def test_spawn_loads_and_steps_the_engine_on_one_thread_and_reports_a_failed_load(engine: Any) -> None:
    threads: set[int] = set()  # the CPU build is slow when one thread loads and another runs

    class Recording:  # the real engine, noting the threads that build and step it
        def __init__(self) -> None:
            threads.add(threading.get_ident())

        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def step(self) -> Any:
            threads.add(threading.get_ident())
            return engine.step()

    broker = MemoryBroker()
    worker = EngineWorker.spawn(Recording, broker)
    submit(broker, "x", max_tokens=3)
    worker.wait_steps(3)
    worker.stop()
    broker.close()
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert not engine.has_unfinished()

    def broken() -> Any:
        raise FileNotFoundError("no weights here")

    with pytest.raises(FileNotFoundError, match="no weights here"):
        EngineWorker.spawn(broken, MemoryBroker())


def test_an_invalid_request_fails_alone_and_goes_to_the_dead_letters(rig: Any) -> None:
    """The issue's case: top_k = 2**64 - 1 overflowed the sampler and failed the whole
    batch. The worker checks every request it pulls against the wire schema."""
    worker, broker, events = rig
    submit(broker, "good", max_tokens=6)
    worker.run_once()
    p = SamplingParams(temperature=1.0, max_tokens=4)
    p.top_k = 2**64 - 1  # past the checks a gateway would have made
    asyncio.run(broker.submit(GenerateRequest("bad", [5, 6], p, arrival_time=time.time())))
    run_until_done(worker)
    (err,) = [e for e in events if e.request_id == "bad"]
    assert (err.finish_reason, err.error_code) == ("error", "invalid_request") and "top_k" in (
        err.error or ""
    )
    assert [e.finish_reason for e in events if e.request_id == "good"][-1] == "length"
    assert sum(len(e.token_ids) for e in events if e.request_id == "good") == 6
    ((item, reason),) = broker.dead_letters
    assert getattr(item, "request_id", None) == "bad" and "top_k" in reason


async def _events_of(broker: Any, rid: str) -> list[TokenEvent]:
    got: list[TokenEvent] = []
    async for batch in broker.events():
        got += [e for e in batch if e.request_id == rid]
        if got and got[-1].finish_reason is not None:
            return got
    return got


def test_a_request_waiting_past_its_queue_deadline_ends_with_queue_timeout_and_frees_its_place(
    rig: Any,
) -> None:
    worker, broker, _ = rig
    for i in range(4):  # max_num_seqs is 4: the engine is full and pulls nothing more
        submit(broker, f"busy{i}", max_tokens=200)
    worker.run_once()
    now = time.time()
    late = GenerateRequest(
        "late", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=now, queue_deadline=now + 0.3
    )
    asyncio.run(broker.submit(late))
    worker.run_once()
    assert asyncio.run(broker.pending()) == 1  # before its deadline it waits
    time.sleep(0.35)
    worker.run_once()
    assert asyncio.run(broker.pending()) == 0  # its place in the queue is free again
    got = asyncio.run(asyncio.wait_for(_events_of(broker, "late"), 5))
    assert [(e.seq, e.finish_reason, e.error_code) for e in got] == [(0, "error", "queue_timeout")]
    assert not worker.engine.is_known("late")
    assert all(worker.engine.is_known(f"busy{i}") for i in range(4))  # the running ones go on


def test_an_engine_that_takes_a_request_past_its_deadline_fails_it_without_running_it(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wsllm.broker.memory

    worker, broker, events = rig
    # The broker sweeps once, now; the deadline then passes before the engine pulls (as
    # between two sweeps, or with a queue that keeps no deadlines): the engine checks too.
    monkeypatch.setattr(wsllm.broker.memory, "_EXPIRY_CHECK_S", 60.0)
    broker.pull(0)
    now = time.time()
    p = SamplingParams(max_tokens=4, temperature=0.0)
    asyncio.run(
        broker.submit(GenerateRequest("stale", [5, 6], p, arrival_time=now, queue_deadline=now + 0.05))
    )
    asyncio.run(broker.submit(GenerateRequest("fresh", [5, 6], p, arrival_time=now, queue_deadline=now + 60)))
    time.sleep(0.1)
    run_until_done(worker)
    (err,) = [e for e in events if e.request_id == "stale"]
    assert (err.seq, err.finish_reason, err.error_code) == (0, "error", "queue_timeout")
    assert [e.finish_reason for e in events if e.request_id == "fresh"][-1] == "length"


def test_a_request_past_its_deadline_in_the_redis_queue_ends_with_queue_timeout_and_never_runs(
    engine: Any, redis_server: Any
) -> None:
    from wsllm.broker.redis import RedisBroker

    redis_server.client().flushall()
    gw = RedisBroker(redis_server.url, model=engine.model_name)
    eb = RedisBroker(redis_server.url, model=engine.model_name, engine_id="e1")
    worker = EngineWorker(engine, eb, idle_wait_s=0.0)
    published: list[TokenEvent] = []
    worker.on_publish = published.extend
    try:
        now = time.time()
        p = SamplingParams(max_tokens=4, temperature=0.0)
        # It waited in the stream while every engine was busy; this engine comes too late.
        stale = GenerateRequest("stale", [5, 6], p, engine.model_name, now - 5, queue_deadline=now - 1)
        fresh = GenerateRequest("fresh", [5, 6], p, engine.model_name, now, queue_deadline=now + 60)
        asyncio.run(gw.submit(stale))
        asyncio.run(gw.submit(fresh))
        deadline = time.monotonic() + 10
        while not any(e.request_id == "fresh" and e.finish_reason for e in published):
            assert time.monotonic() < deadline
            worker.run_once()
        got = asyncio.run(asyncio.wait_for(_events_of(gw, "stale"), 10))
        assert [(e.seq, e.finish_reason, e.error_code) for e in got] == [(0, "error", "queue_timeout")]
        assert not any(e.request_id == "stale" and e.token_ids for e in published)  # it never ran
        assert [e.finish_reason for e in published if e.request_id == "fresh"][-1] == "length"
        assert asyncio.run(gw.pending()) == 0 and not engine.has_unfinished()
    finally:
        worker.drain()
        eb.close()
        gw.close()


def _steps_until_b_starts(
    worker: EngineWorker, broker: MemoryBroker, events: list[TokenEvent], b: str
) -> list[int]:
    """Tenant a queues 64 requests; once four of them run (max_num_seqs), tenant `b`
    sends 4. How many engine steps after that each of b's requests got its first token."""
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def send(rid: str, tenant: str) -> None:
        asyncio.run(
            broker.submit(GenerateRequest(rid, [5, 6, 7], p, arrival_time=time.time(), tenant=tenant))
        )

    for i in range(64):
        send(f"a{i}", "a")
    worker.run_once()
    assert worker.engine.stats().num_running == 4
    for i in range(4):
        send(f"b{i}", b)
    sent_at, first = worker.steps, {}
    while len(first) < 4:
        assert worker.steps - sent_at < 400, "b never started"
        worker.run_once()
        for e in events:
            if e.request_id[0] == "b" and e.token_ids:
                first.setdefault(e.request_id, worker.steps - sent_at)
    return sorted(first.values())


def test_a_tenant_that_floods_the_queue_does_not_starve_one_that_sends_little(rig: Any) -> None:
    worker, broker, events = rig
    waits = _steps_until_b_starts(worker, broker, events, "b")
    # Bound: a's four running requests end within max_tokens (8) steps; the slots they
    # free go to b, whose counter is below a's, at the next pull; the first token comes
    # with the step that admits it.
    assert waits[-1] <= 8 + 2, waits


def test_without_tenants_the_same_queue_is_first_come_first_served(rig: Any) -> None:
    worker, broker, events = rig
    waits = _steps_until_b_starts(worker, broker, events, "a")  # b's requests are a's too
    assert waits[0] >= 60 // 4 * 8, waits  # behind the other 60: 15 rounds of 8 steps


# -- the watchdog (engine/watchdog.py) ----------------------------------------------------------


class _Busy:
    """A worker as the watchdog reads it: busy with `what` since 0, its steps `expected` s."""

    engine_id = "e"

    def __init__(self, what: str, expected: float) -> None:
        self.what, self.expected = what, expected

    def busy(self) -> tuple[float, str] | None:
        return (0.0, self.what)

    def expected_s(self) -> float:
        return self.expected

    def keepalive(self) -> None:
        pass

    def give_up(self, reason: str) -> None:
        raise AssertionError("not called by check()")


def test_a_step_is_stuck_only_past_the_timeout_and_past_the_factor_times_its_recent_steps() -> None:
    """An 8,000-token prompt's chunks (3.5, 6.1, 9.1, 10.6 s) under --stall-timeout-s 8 are
    progress, each a little longer than the last; a step far past both is not."""
    from wsllm.engine.watchdog import Watchdog

    dog = Watchdog(_Busy("one step", expected=3.0), 8.0, lambda why: None, 4.0)
    assert dog.check(now=7.0) is None  # under the timeout
    assert dog.check(now=11.0) is None  # past it, within 4 x the last steps' 3 s
    why = dog.check(now=12.5)
    assert why is not None and "in one step for 12s" in why and "up to 3.00s" in why
    fresh = Watchdog(_Busy("one step", expected=0.0), 8.0, lambda why: None, 4.0)
    assert fresh.check(now=31.0) is None  # no step finished yet: warming up, 4 x the timeout
    assert fresh.check(now=33.0) is not None


def test_the_watchdog_times_adapter_commands_too(engine: Any) -> None:
    """An adapter load that never returns (a hung disk) stalls the engine as a step would."""
    from wsllm.engine.watchdog import Watchdog
    from wsllm.types import AdapterCommand

    release = threading.Event()

    class Adapters:
        allow_dir = "/"

        def names(self) -> list[str]:
            return []

        def load(self, name: str, path: str) -> None:
            release.wait(30)

    class WithAdapters:
        def __init__(self) -> None:
            self.adapters = Adapters()

        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

    broker = MemoryBroker()
    worker = EngineWorker(WithAdapters(), broker, idle_wait_s=0.01)  # type: ignore[arg-type]
    stalls: list[str] = []
    dog = Watchdog(worker, 0.5, stalls.append, 4.0).start()
    worker.start()
    sender = threading.Thread(
        target=lambda: asyncio.run(broker.command("m", AdapterCommand("c1", "load", "x", "/nowhere"), 1, 5)),
        daemon=True,
    )
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while not stalls:
            assert time.monotonic() < deadline, "the watchdog never fired"
            time.sleep(0.05)
        assert "applying adapter commands" in stalls[0] and worker.stalled == stalls[0]
    finally:
        release.set()
        dog.stop()
        worker.stop()
        broker.close()


def test_a_busy_engines_heartbeat_goes_on_from_the_watchdog_from_its_first_step(engine: Any) -> None:
    """A step that takes long (its first on a loaded machine, a long prompt's chunk) is
    not a dead engine: the watchdog heartbeats for it, so that it stays registered and
    (on Redis) keeps its leases, even before its first iteration ended."""
    from wsllm.engine.watchdog import Watchdog

    release = threading.Event()

    class Slow:
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def step(self) -> list[Any]:
            release.wait(30)
            return list(engine.step())

    broker = MemoryBroker()
    submit(broker, "slow")
    worker = EngineWorker(Slow(), broker, idle_wait_s=0.01, heartbeat_s=0.2)  # type: ignore[arg-type]
    dog = Watchdog(worker, 60.0, lambda why: None, 4.0).start()
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while not asyncio.run(broker.engines()):
            assert time.monotonic() < deadline, "no heartbeat while the first step ran"
            time.sleep(0.05)
        assert worker.busy() is not None and worker.steps == 0  # still in that first step
    finally:
        release.set()
        dog.stop()
        worker.stop()
        broker.close()
