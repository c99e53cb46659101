"""The Responses store (wsllm/broker/response_store.py), in memory and in Redis: a
record is its tenant's alone (another tenant reads and deletes nothing, as for an id
that does not exist), expires after its TTL, a tenant over its own budget loses its own
oldest records and nobody else's, a delete leaves a tombstone that no later put passes,
and the in-process store keeps within its byte budget by dropping the oldest records."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from wsllm.broker.memory import MemoryBroker
from wsllm.broker.response_store import Budget, MemoryResponseStore, ResponseStore


@contextlib.contextmanager
def memory_store() -> Iterator[ResponseStore]:
    broker = MemoryBroker()
    try:
        yield broker.response_store()
    finally:
        broker.close()


@contextlib.contextmanager
def redis_store(url: str) -> Iterator[ResponseStore]:
    import redis

    from wsllm.broker.redis import RedisBroker

    redis.Redis.from_url(url).flushall()
    broker = RedisBroker(url, model="m")
    try:
        yield broker.response_store()
    finally:
        broker.close()


@pytest.fixture(params=["memory", "redis"])
def make_store(
    request: pytest.FixtureRequest,
) -> Callable[[], contextlib.AbstractContextManager[ResponseStore]]:
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        return lambda: redis_store(url)
    return memory_store


def test_a_record_is_its_tenants_alone(make_store: Any) -> None:
    async def run(store: ResponseStore) -> None:
        await store.put("resp_1", "alice", b'{"a": 1}', 60)
        assert await store.get("resp_1", "alice") == b'{"a": 1}'
        assert await store.get("resp_1", "bob") is None
        assert await store.get("resp_2", "alice") is None
        assert not await store.delete("resp_1", "bob")
        assert await store.get("resp_1", "alice") == b'{"a": 1}'  # bob's delete did nothing
        assert await store.delete("resp_1", "alice")
        assert await store.get("resp_1", "alice") is None
        assert not await store.delete("resp_1", "alice")

    with make_store() as store:
        asyncio.run(run(store))


def test_a_record_expires_after_its_ttl(make_store: Any) -> None:
    async def run(store: ResponseStore) -> None:
        await store.put("short", "alice", b"x", 0.2)
        await store.put("long", "alice", b"y", 60)
        await asyncio.sleep(0.4)
        assert await store.get("short", "alice") is None
        assert await store.get("long", "alice") == b"y"

    with make_store() as store:
        asyncio.run(run(store))


def test_the_memory_store_drops_the_oldest_past_its_budget() -> None:
    async def run() -> None:
        store = MemoryResponseStore(max_bytes=100)
        for i in range(10):
            await store.put(f"r{i}", "alice", bytes(30), 60)
        assert len(store) == 3  # 3 x 30 bytes fit in 100
        assert [await store.get(f"r{i}", "alice") is not None for i in range(10)] == [False] * 7 + [True] * 3
        await store.put("huge", "alice", bytes(101), 60)  # larger than the whole store: not kept
        assert await store.get("huge", "alice") is None and len(store) == 3

    asyncio.run(run())


def test_the_memory_stores_total_is_paid_by_the_tenant_that_holds_the_most() -> None:
    """Five tenants at the default budget (16 MiB each) are past the store's 64 MiB: the
    total is kept by dropping the largest tenant's oldest records, never a small tenant's
    because it came first."""

    async def run() -> None:
        store, budget = MemoryResponseStore(max_bytes=100), Budget(max_bytes=80, max_records=100)
        assert await store.put("bob-1", "bob", bytes(20), 60, budget)  # the oldest record
        for i in range(4):
            assert await store.put(f"al-{i}", "alice", bytes(20), 60, budget)  # alice: 80, the total 100
        assert await store.put("carol-1", "carol", bytes(20), 60, budget)  # 120: over the total
        assert await store.get("bob-1", "bob") == bytes(20)  # bob holds little: his stays
        assert await store.get("carol-1", "carol") == bytes(20)
        assert await store.get("al-0", "alice") is None and store.tenant_bytes("alice") == 60

    asyncio.run(run())


def test_a_tenant_over_its_budget_loses_its_own_oldest_only(make_store: Any) -> None:
    """One key's 64 records of 1 MiB evicted everyone else's: a budget per tenant."""
    budget = Budget(max_bytes=100, max_records=3)

    async def run(store: ResponseStore) -> None:
        assert await store.put("bob-1", "bob", bytes(50), 60, budget)
        for i in range(5):  # 5 records of 20 bytes: past 3 records
            assert await store.put(f"al-{i}", "alice", bytes(20), 60, budget)
        kept = [await store.get(f"al-{i}", "alice") is not None for i in range(5)]
        assert kept == [False, False, True, True, True]
        assert await store.put("al-big", "alice", bytes(70), 60, budget)  # past 100 bytes: two more go
        assert [await store.get(f"al-{i}", "alice") is not None for i in (3, 4)] == [False, True]
        assert not await store.put("al-huge", "alice", bytes(101), 60, budget)  # larger than the budget
        assert await store.get("bob-1", "bob") == bytes(50)  # bob's record never paid for alice's

    with make_store() as store:
        asyncio.run(run(store))


def test_a_deleted_record_stays_deleted(make_store: Any) -> None:
    """A background response deleted while it runs stored itself again when it ended
    (DELETE answered 200, GET 404, then GET 200 `incomplete`): a tombstone stops it."""

    async def run(store: ResponseStore) -> None:
        await store.put("resp_bg", "alice", b"in progress", 60)
        assert not await store.delete("resp_bg", "bob", 60)
        assert await store.delete("resp_bg", "alice", 60)
        assert not await store.put("resp_bg", "alice", b"incomplete", 60)  # the run's late end
        assert await store.get("resp_bg", "alice") is None
        assert not await store.delete("resp_bg", "alice", 60)  # gone, as for an unknown id

    with make_store() as store:
        asyncio.run(run(store))
