"""The dead letters, on the Redis deployment (the `redis_deployment` fixture):
malformed entries written straight into the request and abort streams land in the
model's dead-letter stream with a reason naming what is wrong, while the engine,
stepping on without a restart, serves the stream beside them and the next request.
The Redis broker's own cases, without a model: tests/unit/test_redis_broker.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from bodies import completion
from redis_fixtures import (
    Deployment,
    Result,
    on_one_and_on_a_cluster,  # noqa: F401 - every test runs on both
    sse_text,
)

from wsllm.broker.redis_keys import Keys


def test_malformed_entries_go_to_the_dead_letters_and_the_engine_serves_on(
    redis_deployment: Deployment,
) -> None:
    dep = redis_deployment
    r = dep.redis
    keys = Keys("wsllm")
    queue, aborts, dead = keys.queue(dep.model), keys.aborts(dep.model), keys.dead(dep.model)
    good = completion([31, 32, 33], 150)
    (alone,) = [asyncio.run(sse_text(dep.a, good))]
    valid = orjson.loads(r.xrange(queue)[0][1][b"r"]) if r.xlen(queue) else None
    template = valid or {
        "v": 1,
        "kind": "request",
        "item": {"request_id": "x", "prompt_token_ids": [1], "params": {}},
    }

    def with_item(**change: Any) -> bytes:
        msg = orjson.loads(orjson.dumps(template))
        msg["item"] |= change
        return orjson.dumps(msg)

    bad_requests = [
        {"r": with_item(request_id="bad-1", prompt_token_ids=5)},
        {"r": with_item(request_id="bad-2", arrival_time="x")},
        {"r": with_item(request_id="bad-3", params={"top_k": 2**64 - 1})},
        {"r": b"\xff not json"},
        {"nothing": b"here"},
    ]
    bad_aborts: list[dict[str, bytes]] = [{"x": b"1"}, {"r": b"\xff\xfe"}, {"r": b"a" * 1000}]
    steps = dep.worker.steps
    thread = dep.worker._thread

    async def go() -> Result:
        task = asyncio.create_task(sse_text(dep.a, good))
        await asyncio.sleep(0.3)  # it streams now
        for fields in bad_requests:
            r.xadd(queue, fields)
        for fields in bad_aborts:
            r.xadd(aborts, fields)
        return await task

    res = asyncio.run(go())
    assert res.finish_reason == "length" and res.text == alone.text
    deadline = time.monotonic() + 10
    while r.xlen(dead) < len(bad_requests) + len(bad_aborts):
        assert time.monotonic() < deadline, r.xrange(dead)
        time.sleep(0.05)
    reasons = [f[b"reason"].decode() for _, f in r.xrange(dead)]
    assert sum(x.startswith("invalid request entry") for x in reasons) == len(bad_requests), reasons
    assert sum(x.startswith("invalid abort entry") for x in reasons) == len(bad_aborts), reasons
    assert any("prompt_token_ids" in x for x in reasons) and any("top_k" in x for x in reasons)
    assert any("arrival_time" in x for x in reasons)
    # the same engine, still stepping, serves the next request
    assert dep.worker._thread is thread and thread.is_alive() and dep.worker.steps > steps
    assert asyncio.run(sse_text(dep.b, completion([1, 2], 5))).finish_reason == "length"
    assert r.xlen(queue) == 0
    dep.engine_idle()
