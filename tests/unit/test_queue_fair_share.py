"""Priority and fair share across the queue, on the memory broker and on Redis, with a
real (tiny, random) engine stepped by hand: a tenant that floods the queue is refused
for its own share only, and when a slot frees, a higher-priority request, then another
tenant's, starts within one engine step. Waiting requests of the new structure can
still be aborted, time out, and are handed back and recovered like any other."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wsllm.broker.base import Broker, QueueFull
from wsllm.broker.fair_queue import tenant_cap
from wsllm.broker.memory import MemoryBroker
from wsllm.config import EngineConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.types import GenerateRequest, SamplingParams, TokenEvent

DEPTH, SHARE = 8, 0.5


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:
    from wsllm.engine.engine import LLMEngine

    return LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=2, dtype="float32")
    )


@contextlib.contextmanager
def memory() -> Iterator[Broker]:
    b = MemoryBroker(max_queue_depth=DEPTH, max_queue_share=SHARE)
    yield b
    b.close()


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def make(request: pytest.FixtureRequest) -> Callable[..., contextlib.AbstractContextManager[Broker]]:
    """The memory broker, one redis-server, a 3-master Redis Cluster."""
    if request.param == "memory":
        return memory
    from wsllm.broker.redis import RedisBroker

    server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    url = server.url
    server.client().flushall()

    @contextlib.contextmanager
    def redis(**cfg: Any) -> Iterator[Broker]:
        b = RedisBroker(
            url,
            model="m",
            cfg=RedisConfig(**cfg),
            max_queue_depth=DEPTH,
            max_queue_share=SHARE,
            engine_id="e1",
        )
        yield b
        b.close()

    return redis


def req(
    rid: str, tenant: str, priority: int = 0, max_tokens: int = 6, deadline: float = 0.0
) -> GenerateRequest:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    now = time.time()
    return GenerateRequest(
        rid,
        [5, 6, 7],
        p,
        model="m",
        arrival_time=now,
        priority=priority,
        tenant=tenant,
        queue_deadline=deadline,
    )


def submit(b: Broker, r: GenerateRequest) -> None:
    asyncio.run(b.submit(r))


def test_a_flooding_tenant_is_refused_for_its_share_only_and_others_start_at_the_next_step(
    make: Any, engine: Any
) -> None:
    with make() as b:
        cap = tenant_cap(DEPTH, SHARE)
        for i in range(cap):
            submit(b, req(f"f{i}", "flood"))
        with pytest.raises(QueueFull, match="tenant"):
            submit(b, req("f-over", "flood"))
        worker = EngineWorker(engine, b, idle_wait_s=0.0)
        events: list[TokenEvent] = []
        worker.on_publish = events.extend
        try:
            worker.run_once()  # two of the flood run: the engine is full
            assert engine.stats().num_running == 2
            submit(b, req("other", "other"))  # the queue is not full for the others
            submit(b, req("vip", "vip", priority=5))
            assert asyncio.run(b.pending()) == cap - 2 + 2
            first: dict[str, int] = {}
            freed: list[int] = []
            for _ in range(60):
                worker.run_once()
                for e in events:
                    if e.token_ids:
                        first.setdefault(e.request_id, worker.steps)
                    if e.finish_reason and e.request_id.startswith("f"):
                        freed.append(worker.steps) if worker.steps not in freed else None
                events.clear()
                if "other" in first and "vip" in first:
                    break
            # The two flood requests end together (same length): both slots free in one
            # step; the next step starts the higher priority one and the other tenant's,
            # ahead of the flood's own waiting requests.
            assert first["vip"] == freed[0] + 1 and first["other"] == freed[0] + 1, (first, freed)
            assert not any(f"f{i}" in first for i in range(2, cap))
        finally:
            worker.drain()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_turns_go_round_the_tenants_within_a_level_and_levels_go_highest_first(make: Any) -> None:
    with make() as b:
        for i in range(3):
            submit(b, req(f"a{i}", "a"))
        submit(b, req("b0", "b"))
        submit(b, req("b1", "b"))
        submit(b, req("low", "c", priority=-1))
        submit(b, req("high", "c", priority=2))
        got = []
        for _ in range(7):
            got += [r.request_id for r in b.pull(1, timeout=1.0)]
        assert got == ["high", "a0", "b0", "a1", "b1", "a2", "low"]


def test_waiting_requests_abort_expire_and_are_counted_per_tenant(make: Any) -> None:
    with make() as b:
        submit(b, req("gone", "a"))
        submit(b, req("late", "a", deadline=time.time() + 0.2))
        submit(b, req("kept", "a"))
        asyncio.run(b.abort("gone"))
        submit(b, req("more", "a"))  # the aborted one's place is free again
        time.sleep(0.3)
        got = [r.request_id for r in b.pull(8, timeout=1.0)]
        got += [r.request_id for r in b.pull(8, timeout=0.3)]
        assert got == ["kept", "more"]
        for i in range(tenant_cap(DEPTH, SHARE)):
            submit(b, req(f"x{i}", "a"))  # its share is free again


def test_a_taken_request_is_handed_back_and_recovered_through_the_request_stream(any_redis: Any) -> None:
    from wsllm.broker.redis import RedisBroker

    any_redis.client().flushall()
    cfg = RedisConfig(lease_s=1.0, engine_heartbeat_s=0.2)
    a = RedisBroker(any_redis.url, model="m", cfg=cfg, engine_id="a", max_queue_depth=DEPTH)
    b = RedisBroker(any_redis.url, model="m", cfg=cfg, engine_id="b", max_queue_depth=DEPTH)
    try:
        submit(a, req("back", "t", priority=1))
        submit(a, req("crash", "u"))
        assert [r.request_id for r in a.pull(1, timeout=1.0)] == ["back"]
        assert a.release(["back"]) == []
        assert [r.request_id for r in b.pull(1, timeout=1.0)] == ["back"]  # hand-backs go first
        assert [r.request_id for r in a.pull(1, timeout=1.0)] == ["crash"]  # then a stops heartbeating
        time.sleep(1.2)
        deadline = time.monotonic() + 5
        got: list[str] = []
        while not got and time.monotonic() < deadline:
            got = [r.request_id for r in b.pull(4, timeout=0.2)]
        assert got == ["crash"]  # XAUTOCLAIM found it in the request stream
    finally:
        a.close()
        b.close()


def test_once_every_waiting_request_is_taken_the_turn_keys_are_gone(make: Any) -> None:
    """The levels, the tenants' turns and their streams live only while requests wait
    (the take removes them as it empties them): the soak's 'Redis as it found it'."""
    with make() as b:
        if not hasattr(b, "_sync"):
            pytest.skip("the memory broker keeps no keys")
        for i in range(6):
            submit(b, req(f"w{i}", f"t{i % 3}", priority=i % 2))
        got: list[str] = []
        for _ in range(10):
            got += [r.request_id for r in b.pull(2, timeout=0.5)]
            if len(got) == 6:
                break
        assert sorted(got) == [f"w{i}" for i in range(6)]
        lasting = (b":nt", b":seen", b":tk", b":rc")  # :rc, recovery's turn, expires by itself
        turn_keys = [k for k in b.r.scan_iter(match="*:q:*") if not k.endswith(lasting)]
        assert turn_keys == []
