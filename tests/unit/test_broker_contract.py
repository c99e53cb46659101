"""The broker contract (wsllm/broker/base.py), run against every broker.

To add a broker, add a factory to BROKERS: a context manager that yields a fresh,
empty broker and cleans up after it. The Redis broker runs on the session's real
redis-server (tests/conftest.py), flushed before each test."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from wsllm.broker.base import Broker, BrokerClosed, EngineInfo, QueueFull
from wsllm.broker.memory import MemoryBroker
from wsllm.types import GenerateRequest, PromptImage, SamplingParams, TokenEvent, Usage


@contextlib.contextmanager
def memory_broker(max_queue_depth: int = 8) -> Iterator[Broker]:
    b = MemoryBroker(max_queue_depth=max_queue_depth, max_event_batches=4)
    try:
        yield b
    finally:
        b.close()


@contextlib.contextmanager
def redis_broker(url: str, max_queue_depth: int = 8) -> Iterator[Broker]:
    import redis

    from wsllm.broker.redis import RedisBroker

    redis.Redis.from_url(url).flushall()
    b = RedisBroker(url, model="m", max_queue_depth=max_queue_depth)
    try:
        yield b
    finally:
        b.close()


BROKERS: dict[str, Callable[..., contextlib.AbstractContextManager[Broker]]] = {
    "memory": memory_broker,
    "redis": redis_broker,
}


@pytest.fixture(params=sorted(BROKERS))
def make_broker(request: pytest.FixtureRequest) -> Callable[..., contextlib.AbstractContextManager[Broker]]:
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        return functools.partial(redis_broker, url)
    return BROKERS[request.param]


def req(rid: str, n_prompt: int = 3) -> GenerateRequest:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[2], seed=7)
    return GenerateRequest(rid, list(range(1, n_prompt + 1)), params, model="m", arrival_time=time.time())


async def collect(broker: Broker, n_events: int, timeout: float = 5.0) -> list[TokenEvent]:
    """Read batches until n_events events came."""
    got: list[TokenEvent] = []

    async def read() -> None:
        async for batch in broker.events():
            got.extend(batch)
            if len(got) >= n_events:
                return

    await asyncio.wait_for(read(), timeout)
    return got


def test_submit_then_pull_is_fifo_and_lossless(make_broker):
    with make_broker() as b:
        sent = [req(f"r{i}", n_prompt=i + 1) for i in range(5)]
        # an image's file, digest and placeholder span cross whole (`images` is left off the
        # wire of a request without one)
        sent[4].images = [PromptImage.of(b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "ab" * 32, 1, 3)]

        async def submit_all() -> None:
            for r in sent:
                await b.submit(r)

        asyncio.run(submit_all())
        first = b.pull(2)
        rest = b.pull(10)
        assert [r.request_id for r in first + rest] == [f"r{i}" for i in range(5)]
        # What crosses the broker comes out equal, params included.
        assert rest[-1].prompt_token_ids == [1, 2, 3, 4, 5]
        assert rest[-1].params == req("x").params
        assert rest[-1].images == sent[4].images and rest[-1].images[0].file() == sent[4].images[0].file()
        assert rest[0].images == []
        assert b.pull(10) == []


def test_pull_waits_for_a_submit_from_the_loop(make_broker):
    with make_broker() as b:
        got: list[GenerateRequest] = []
        t = threading.Thread(target=lambda: got.extend(b.pull(4, timeout=5.0)))
        t.start()
        time.sleep(0.05)
        asyncio.run(b.submit(req("late")))
        t.join(5.0)
        assert [r.request_id for r in got] == ["late"]


def test_pull_timeout_returns_empty(make_broker):
    with make_broker() as b:
        t0 = time.monotonic()
        assert b.pull(4, timeout=0.2) == []
        assert 0.15 <= time.monotonic() - t0 < 2.0
        assert b.pull(0, timeout=1.0) == []


def test_queue_full_is_an_error_not_a_wait(make_broker):
    with make_broker(max_queue_depth=2) as b:

        async def go() -> None:
            await b.submit(req("a"))
            await b.submit(req("b"))
            with pytest.raises(QueueFull):
                await b.submit(req("c"))
            b.pull(1)
            await b.submit(req("c"))  # room again

        asyncio.run(go())


def test_abort_before_pull_drops_the_request(make_broker):
    with make_broker() as b:

        async def go() -> None:
            await b.submit(req("keep"))
            await b.submit(req("drop"))
            await b.abort("drop")

        asyncio.run(go())
        assert [r.request_id for r in b.pull(10)] == ["keep"]


def test_abort_after_pull_reaches_the_engine_once(make_broker):
    with make_broker() as b:
        asyncio.run(b.submit(req("a")))
        assert len(b.pull(1)) == 1

        async def go() -> None:
            await b.abort("a")
            await b.abort("a")  # idempotent

        asyncio.run(go())
        assert b.aborts() == ["a"]
        assert b.aborts() == []


def test_published_batches_arrive_in_order_from_another_thread(make_broker):
    with make_broker() as b:
        n = 50  # more batches than the memory broker buffers: publish must wait, not drop

        async def submit_both() -> None:  # events come back for requests this gateway submitted
            await b.submit(req("a"))
            await b.submit(req("b"))

        asyncio.run(submit_both())
        assert len(b.pull(2)) == 2

        def engine() -> None:
            for i in range(n):
                usage = Usage(3, 1) if i == n - 1 else None
                b.publish([TokenEvent("a", i, [i], usage=usage), TokenEvent("b", i, [i, i])])

        async def go() -> list[TokenEvent]:
            t = threading.Thread(target=engine)
            t.start()
            # The loop keeps running while the engine publishes.
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(tick())
            got = await collect(b, 2 * n)
            ticker.cancel()
            await asyncio.to_thread(t.join, 5.0)
            assert ticks > 0
            return got

        got = asyncio.run(go())
        # In publish order per request (the order across requests is not promised).
        assert [e.seq for e in got if e.request_id == "a"] == list(range(n))
        assert [e.token_ids for e in got if e.request_id == "b"] == [[i, i] for i in range(n)]
        assert [e for e in got if e.request_id == "a"][-1].usage == Usage(3, 1)


def test_engines_registry_tracks_heartbeats(make_broker):
    with make_broker() as b:
        assert asyncio.run(b.engines()) == []
        b.heartbeat(EngineInfo("e1", "m", 2048, stats={"num_running": 1, "kv_usage": 0.5}))
        (info,) = asyncio.run(b.engines())
        assert (info.engine_id, info.model, info.max_model_len) == ("e1", "m", 2048)
        assert info.stats["kv_usage"] == 0.5
        assert time.time() - info.last_seen < 5
        b.engine_ttl_s = 0.0
        time.sleep(0.01)
        assert asyncio.run(b.engines()) == []  # stale
        b.engine_ttl_s = 10.0
        b.heartbeat(EngineInfo("e1", "m", 2048))
        b.deregister("e1")
        assert asyncio.run(b.engines()) == []


def test_close_ends_everything(make_broker):
    with make_broker() as b:

        async def go() -> None:
            reader = asyncio.create_task(collect(b, 1))
            await asyncio.sleep(0.05)
            b.close()
            assert await asyncio.wait_for(reader, 5.0) == []
            with pytest.raises(BrokerClosed):
                await b.submit(req("x"))

        asyncio.run(go())
        t0 = time.monotonic()
        assert b.pull(4, timeout=5.0) == []
        assert time.monotonic() - t0 < 1.0
        b.publish([TokenEvent("x", 0, [1])])  # dropped, never blocks


def test_memory_engine_sides_take_only_their_models_work_and_see_every_abort() -> None:
    """`wsllm serve --model A --model B`: each model's engine pulls through its own view."""
    with memory_broker() as b:
        assert isinstance(b, MemoryBroker)
        side_a, side_b = b.engine_side("A"), b.engine_side("B")

        async def submit() -> None:
            for rid, model in (("a1", "A"), ("b1", "B"), ("a2", "A")):
                r = req(rid)
                r.model = model
                await b.submit(r)

        asyncio.run(submit())
        assert [r.request_id for r in side_b.pull(8)] == ["b1"]  # A's requests stay queued
        assert side_b.pull(8, timeout=0.05) == []
        assert [r.request_id for r in side_a.pull(8)] == ["a1", "a2"]
        asyncio.run(b.abort("a1"))  # pulled already: a broadcast, as on Redis
        assert side_a.aborts() == ["a1"] and side_b.aborts() == ["a1"]
        assert side_a.aborts() == []


def _engine_side_classes() -> list[type]:
    from wsllm.broker.base import EngineBroker
    from wsllm.broker.redis import RedisBroker
    from wsllm.broker.redis_engine import RedisEngine

    with memory_broker() as b:
        model_side = type(b.engine_side("A"))
    return [EngineBroker, MemoryBroker, model_side, RedisEngine, RedisBroker]


@pytest.mark.parametrize("side", _engine_side_classes(), ids=lambda c: c.__name__)
def test_every_engine_side_offers_what_the_worker_calls(side: type) -> None:
    """The worker declares the broker it uses (worker_contract.BrokerSide) and does not import
    the broker package: each engine side must take the same calls, argument for argument."""
    from wsllm.engine.worker_contract import BrokerSide

    wanted = [n for n, v in vars(BrokerSide).items() if callable(v) and not n.startswith("_")]
    assert {"pull", "aborts", "publish", "heartbeat", "release"} <= set(wanted)
    for name in wanted:
        want = inspect.signature(getattr(BrokerSide, name)).parameters
        got = inspect.signature(getattr(side, name)).parameters
        shape = lambda ps: [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in ps.values()]  # noqa: E731
        assert shape(got) == shape(want), (
            f"{side.__name__}.{name}{list(got)} is not the worker's {list(want)}"
        )
