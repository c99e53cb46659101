"""Redis stream retention (on one redis-server and a Redis Cluster, broker objects driven
by hand as in test_redis_broker.py): a request's events outlive it for a resume only as
long as a client may still want them, and within a bound. The client took its whole
answer: its keys go at once (`retire`). An ended request's last events are copied to its
own stream, so the gateways' results streams need only a short tail, not the retention.
What stays is bounded per tenant in bytes (`--stream-retention-tenant-bytes`): past it the
tenant's own oldest go, never another tenant's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from wsllm.broker.base import EngineInfo
from wsllm.broker.redis import RedisBroker
from wsllm.config_redis import RedisConfig
from wsllm.types import GenerateRequest, SamplingParams, TokenEvent, Usage

CFG = RedisConfig(stream_retention_s=300.0, history_flush_s=10.0, stream_retention_tenant_bytes=20_000)


@pytest.fixture
def brokers(any_redis: Any) -> Iterator[Any]:
    any_redis.client().flushall()
    made: list[RedisBroker] = []

    def make(engine_id: str | None = None) -> RedisBroker:
        b = RedisBroker(str(any_redis.url), model="m", cfg=CFG, engine_id=engine_id)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def submit(gw: RedisBroker, rid: str, tenant: str) -> None:
    p = SamplingParams(max_tokens=64, temperature=0.0)
    asyncio.run(
        gw.submit(GenerateRequest(rid, [1, 2, 3], p, model="m", arrival_time=time.time(), tenant=tenant))
    )


def take(engine: RedisBroker, n: int) -> None:
    got: list[GenerateRequest] = []
    deadline = time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < deadline
        got += engine.pull(n - len(got), timeout=0.1)
        engine.heartbeat(EngineInfo(engine.consumer, "m", 2048))


def run_to_end(engine: RedisBroker, rid: str, tokens: int = 40) -> None:
    """Its events, then its end, as an engine step publishes them."""
    for seq in range(tokens - 1):
        engine.publish([TokenEvent(rid, seq, [100 + seq])])
    engine.publish([TokenEvent(rid, tokens - 1, [7], finish_reason="length", usage=Usage(3, tokens))])


def test_a_whole_answer_taken_by_its_client_leaves_no_key(brokers: Any) -> None:
    gw, engine = brokers(), brokers("engine-a")
    submit(gw, "w1", "alice")
    take(engine, 1)
    run_to_end(engine, "w1", 5)
    r = engine.r
    assert r.exists(engine.keys.out("m", "w1"))  # resumable: its client has not said it has it all
    asyncio.run(gw.retire("w1", "m", "alice"))
    assert not r.exists(engine.keys.out("m", "w1")) and not r.exists(engine.keys.attached("m", "w1"))
    assert asyncio.run(gw.lookup("w1")) is None  # a resume now: unknown


def test_an_ended_request_resumes_from_its_own_stream_after_the_results_tail(brokers: Any) -> None:
    """The results stream keeps a short tail (not the 300 s retention): an ended request's
    last events are in its own stream, and a resume reads them all from there."""
    assert CFG.results_tail_s == 30.0  # 10 s + 2 x history_flush_s, whatever the retention
    gw, engine = brokers(), brokers("engine-a")
    submit(gw, "w2", "alice")
    take(engine, 1)
    run_to_end(engine, "w2", 5)
    engine.r.delete(engine.keys.results("m", gw.gateway_id))  # past its tail: trimmed away
    other = brokers()

    async def resume() -> list[TokenEvent]:
        await other.follow("w2")
        got: list[TokenEvent] = []
        async for batch in other.events():
            got += [e for e in batch if e.request_id == "w2"]
            if got and got[-1].finish_reason is not None:
                return got
        return got

    got = asyncio.run(asyncio.wait_for(resume(), 10))
    assert [t for e in got for t in e.token_ids] == [100, 101, 102, 103, 7]


def test_a_tenants_kept_streams_stay_within_its_bytes_and_cost_no_other_tenant(brokers: Any) -> None:
    gw, engine = brokers(), brokers("engine-a")
    submit(gw, "bob-1", "bob")
    for i in range(12):
        submit(gw, f"alice-{i}", "alice")
    take(engine, 13)
    run_to_end(engine, "bob-1", 5)
    for i in range(12):  # their clients left: nobody retires them
        run_to_end(engine, f"alice-{i}", 5)
    r, keys = engine.r, engine.keys
    kept = [i for i in range(12) if r.exists(keys.out("m", f"alice-{i}"))]
    assert kept and kept == list(range(12 - len(kept), 12)), kept  # the newest, the oldest gone
    held = sum(r.memory_usage(keys.out("m", f"alice-{i}")) or 0 for i in kept)
    assert len(kept) < 12 and held <= 1.25 * CFG.stream_retention_tenant_bytes, (kept, held)
    assert r.exists(keys.out("m", "bob-1"))  # another tenant's is not touched
