"""The router's orphan deadline, rule by rule, on a clock the test moves (`sweep`):
a queued request behind a live engine is never cut; one whose model has no engine is,
after the deadline; one that started and then heard nothing is, after the deadline."""

from __future__ import annotations

import pytest

from wsllm.broker.memory import MemoryBroker
from wsllm.server.router import Router
from wsllm.types import TokenEvent

T = 5.0


@pytest.fixture
def router() -> Router:
    return Router(MemoryBroker(), max_buffered_events=16, orphan_timeout_s=T)


def test_a_queued_request_behind_a_live_engine_waits_as_long_as_it_takes(router: Router) -> None:
    inbox = router.open("r", "m")
    t0 = inbox.moved_at
    for k in range(1, 40):
        assert router.sweep({"m"}, t0 + k * T / 2) == []
    assert inbox.orphaned is None


def test_a_request_whose_model_has_no_engine_ends_after_the_deadline(router: Router) -> None:
    router.sweep({"m", "other"}, 0.0)
    inbox = router.open("r", "m")
    t0 = inbox.moved_at
    assert router.sweep({"other"}, t0 + T - 0.1) == []  # another model's engine does not count
    assert router.sweep({"other"}, t0 + T) == ["r"]
    assert inbox.orphaned is not None and "no engine" in inbox.orphaned


def test_the_engine_clock_starts_at_its_last_heartbeat_not_at_the_request(router: Router) -> None:
    inbox = router.open("r", "m")
    t0 = inbox.moved_at
    router.sweep({"m"}, t0 + 10 * T)  # seen alive long after the request came
    assert router.sweep(set(), t0 + 11 * T - 0.1) == []
    assert router.sweep(set(), t0 + 11 * T) == ["r"]


def test_a_started_request_that_hears_nothing_ends_after_the_deadline(router: Router) -> None:
    inbox = router.open("r", "m")
    inbox.put(TokenEvent("r", 0, [1]))
    t1 = inbox.moved_at
    assert router.sweep({"m"}, t1 + T - 0.1) == []
    inbox.put(TokenEvent("r", 1, [2]))  # an event moves the deadline
    t2 = inbox.moved_at
    assert router.sweep({"m"}, t2 + T - 0.1) == []
    assert router.sweep({"m"}, t2 + T) == ["r"]
    assert inbox.orphaned is not None and "nothing came" in inbox.orphaned
    assert router.sweep({"m"}, t2 + 2 * T) == []  # once


def test_an_orphan_wakes_its_reader_and_a_closed_request_is_not_watched(router: Router) -> None:
    import asyncio

    async def go() -> list[TokenEvent]:
        inbox = router.open("r", "m")
        waiting = asyncio.create_task(inbox.take(None))
        await asyncio.sleep(0)
        router.sweep(set(), inbox.moved_at + T)
        return await asyncio.wait_for(waiting, 1)

    assert asyncio.run(go()) == []
    router.close("r")
    assert router.sweep(set(), 1e9) == []


def test_an_engine_that_names_no_model_counts_for_every_model(router: Router) -> None:
    inbox = router.open("r", "m")
    t0 = inbox.moved_at
    assert router.sweep({""}, t0 + 3 * T) == []
    nameless = router.open("s")  # a request for no model in particular: any engine serves it
    assert router.sweep({"other"}, nameless.moved_at + 3 * T) == []
    assert inbox.orphaned is None and nameless.orphaned is None
