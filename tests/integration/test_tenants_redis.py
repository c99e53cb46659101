"""Tenants on Redis: two gateways (in this process) on one Redis with an engine worker
on the tiny model share every tenant's counters. A tenant that spends its tpm through
gateway 1 is refused by gateway 2; another tenant is served by both. A crashed
gateway's concurrency lease expires by itself, and every limit key has a TTL (a debt's
lasts until it is repaid). A
request whose client left keeps its lease while it runs on for a resume; the resume
takes the lease again (its own does not count against it) and one request of rpm."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_fixtures import on_one_and_on_a_cluster  # noqa: F401 - every test runs on both

from wsllm.broker.limits import Limits
from wsllm.broker.redis import RedisBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.server.app import create_app

KEYS = """
[tenants.alice]
keys = ["sk-alice"]
tpm = 300

[tenants.bob]
keys = ["sk-bob"]
rpm = 1000
tpm = 100000

[tenants.dave]
keys = ["sk-dave"]
max_concurrent = 1

[tenants.erin]
keys = ["sk-erin"]
rpm = 3
"""
LEASE_S = 3.0


@pytest.fixture(scope="module")
def gateways(
    redis_server: Any, tiny_engine: Any, tiny_model_dir: Path, uvicorn_thread: Any, tmp_path_factory: Any
) -> Iterator[tuple[str, str]]:
    redis_server.client().flushall()
    model = tiny_model_dir.name
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    rcfg = RedisConfig(engine_ttl_s=5, limit_lease_s=LEASE_S)
    engine_side = RedisBroker(redis_server.url, model=model, cfg=rcfg, engine_id="engine-t")
    worker = EngineWorker(tiny_engine, engine_side, engine_id="engine-t", heartbeat_s=0.2)
    worker.start()
    brokers = [RedisBroker(redis_server.url, model=model, cfg=rcfg) for _ in range(2)]
    cfg = GatewayConfig(frontend=False, api_keys_file=str(keys))
    try:
        with contextlib.ExitStack() as stack:
            urls = [
                stack.enter_context(
                    uvicorn_thread(lambda c, b=b: create_app(c, b, tiny_model_dir, model), cfg)
                )[0]
                for b in brokers
            ]
            for url in urls:
                deadline = time.monotonic() + 30
                while (
                    httpx.get(f"{url}/ready", headers={"authorization": "Bearer sk-bob"}).status_code != 200
                ):
                    assert time.monotonic() < deadline, "the gateway did not become ready"
                    time.sleep(0.05)
            yield urls[0], urls[1]
    finally:
        worker.stop()
        for b in brokers:
            b.close()
        engine_side.close()


def post(url: str, key: str, max_tokens: int) -> httpx.Response:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(
        f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def test_two_gateways_share_a_tenants_tokens(gateways: tuple[str, str], redis_server: Any) -> None:
    one, two = gateways
    spent = post(one, "sk-alice", 200)  # 204 of alice's 300 tokens, all used
    assert spent.status_code == 200 and spent.headers["x-ratelimit-remaining-tokens"] in ("96", "97")
    refused = post(two, "sk-alice", 200)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limited"
    assert refused.headers["x-ratelimit-limit-tokens"] == "300"
    assert post(one, "sk-alice", 200).status_code == 429  # and gateway 1 agrees
    for url in (one, two):  # bob goes on, on both
        ok = post(url, "sk-bob", 4)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    r = redis_server.client()
    limit_keys = list(r.scan_iter(match="wsllm:{t:*}:*"))  # every master of a cluster
    assert limit_keys and all(r.pttl(k) > 0 for k in limit_keys)  # nothing stays for ever


def test_a_crashed_gateways_lease_expires(gateways: tuple[str, str], redis_server: Any) -> None:
    """A gateway that dies holding a lease (no release, no refresh) blocks the tenant's
    concurrency only until the lease expires."""
    limits = Limits(max_concurrent=1)
    crashed = RedisBroker(redis_server.url, model="x", cfg=RedisConfig(limit_lease_s=LEASE_S))
    alive = RedisBroker(redis_server.url, model="x", cfg=RedisConfig(limit_lease_s=LEASE_S))

    async def go() -> tuple[bool, bool, float]:
        lost = crashed.limiter()
        assert (await lost.acquire("carol", limits, "r1", 1)).allowed
        await lost.aclose()  # the crash: it never releases nor refreshes r1
        other = alive.limiter()
        blocked = (await other.acquire("carol", limits, "r2", 1)).allowed
        start = time.monotonic()
        while not (await other.acquire("carol", limits, "r3", 1)).allowed:
            assert time.monotonic() - start < LEASE_S + 3, "the dead gateway's lease did not expire"
            await asyncio.sleep(0.1)
        await other.release("carol", limits, "r3", 0)
        await other.aclose()
        return blocked, True, time.monotonic() - start

    try:
        blocked, freed, waited = asyncio.run(go())
    finally:
        crashed.close()
        alive.close()
    assert not blocked and freed and waited > 1.0


def test_a_debt_outlives_the_window_until_it_is_repaid(redis_server: Any) -> None:
    """A bucket key expired 61 s after its last change, and a debt with it: a tenant in
    debt got a full bucket a minute later. It now lives until it would be full again."""
    broker = RedisBroker(redis_server.url, model="x", cfg=RedisConfig())
    limits = Limits(tpm=1000)

    async def go() -> float:
        lim = broker.limiter()
        level = await lim.adjust("fay", limits, 6000)  # 1,000 in the bucket, 6,000 taken
        await lim.aclose()
        return level

    try:
        assert asyncio.run(go()) == -5000
        r = redis_server.client()
        (key,) = list(r.scan_iter(match="wsllm:{t:fay}:tpm*"))
        # 6,000 tokens to refill at 1,000 a minute: 6 minutes (and a second)
        assert 6 * 60_000 - 5_000 < r.pttl(key) <= 6 * 60_000 + 1_000
    finally:
        broker.close()


def test_a_live_lease_is_refreshed(redis_server: Any) -> None:
    """A request longer than the lease keeps its slot while its gateway lives."""
    limits = Limits(max_concurrent=1)
    broker = RedisBroker(redis_server.url, model="x", cfg=RedisConfig(limit_lease_s=LEASE_S))

    async def go() -> bool:
        lim = broker.limiter()
        assert (await lim.acquire("dan", limits, "long", 1)).allowed
        await asyncio.sleep(LEASE_S + 1)
        still_held = not (await lim.acquire("dan", limits, "next", 1)).allowed
        await lim.release("dan", limits, "long", 0)
        assert (await lim.acquire("dan", limits, "next", 1)).allowed
        await lim.release("dan", limits, "next", 0)
        await lim.aclose()
        return still_held

    try:
        assert asyncio.run(go())
    finally:
        broker.close()


def stream_until_first_chunk(url: str, key: str, max_tokens: int, read_all: bool = False) -> str:
    """Start a streamed request, read its first chunk (or all of it), and leave; its
    resume token."""
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {key}"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]" or (line.startswith("data: {") and not read_all):
                break
        return r.headers["x-resume-token"]


def test_a_client_that_leaves_keeps_its_lease_and_a_resume_takes_it_again(
    gateways: tuple[str, str],
) -> None:
    one, two = gateways
    token = stream_until_first_chunk(one, "sk-dave", 1500)  # and the client is gone
    # The request runs on for a resume: it still holds dave's one slot, on every gateway.
    refused = post(two, "sk-dave", 4)
    assert refused.status_code == 429 and "1 requests at once" in refused.json()["error"]["message"]
    rid = token.rpartition(".")[0]
    headers = {"authorization": "Bearer sk-dave", "x-resume-token": token}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("GET", f"{two}/v1/streams/{rid}", headers=headers) as r,
    ):
        assert r.status_code == 200  # its own lease does not count against its resume
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert post(one, "sk-dave", 4).status_code == 429  # and it holds the slot again
        assert any(line == "data: [DONE]" for line in lines)
    deadline = time.monotonic() + 10  # it ended: the slot is free
    while (again := post(one, "sk-dave", 4)).status_code != 200:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.1)


def test_another_keys_resume_with_a_streams_token_is_a_404_like_an_unknown_token(
    gateways: tuple[str, str],
) -> None:
    """A resume token is its tenant's: another key that has it (a leaked log, a shared
    proxy) gets the same 404 as for a token that names nothing, on any gateway, over SSE
    and the WebSocket; the owner's own resume goes on."""
    import orjson
    import websockets

    one, two = gateways
    token = stream_until_first_chunk(one, "sk-bob", 200)  # bob's, and bob left
    rid = token.rpartition(".")[0]
    for url in (one, two):
        other = httpx.get(
            f"{url}/v1/streams/{rid}", headers={"authorization": "Bearer sk-alice", "x-resume-token": token}
        )
        assert other.status_code == 404 and other.json()["error"]["code"] == "unknown_id", other.text

    async def ws_resume(key: str) -> dict[str, Any]:
        ws_base = two.replace("http", "ws", 1)
        async with websockets.connect(
            f"{ws_base}/v1/ws", additional_headers={"authorization": f"Bearer {key}"}, close_timeout=1
        ) as ws:
            await ws.recv()  # hello
            msg = {"type": "resume", "id": "r", "resume_token": token, "after_seq": -1}
            await ws.send(orjson.dumps(msg).decode())
            while True:
                msg = orjson.loads(await ws.recv())
                if msg["type"] in ("error", "delta"):
                    return dict(msg)

    refused = asyncio.run(ws_resume("sk-alice"))
    assert refused["type"] == "error" and refused["code"] == "unknown_id", refused
    assert asyncio.run(ws_resume("sk-bob"))["type"] == "delta"  # the owner's


def test_a_resume_takes_one_request_of_rpm(gateways: tuple[str, str]) -> None:
    one, two = gateways
    token = stream_until_first_chunk(one, "sk-erin", 4)  # 1 of erin's 3, and the client left
    rid = token.rpartition(".")[0]
    headers = {"authorization": "Bearer sk-erin", "x-resume-token": token}
    replays = [httpx.get(f"{two}/v1/streams/{rid}", headers=headers, timeout=60) for _ in range(3)]
    # the first replay takes the whole answer (its stream then goes: the second finds nothing,
    # its request of rpm taken all the same), the third is past the rpm
    assert [r.status_code for r in replays] == [200, 404, 429]
    assert replays[2].json()["error"]["code"] == "rate_limited"
    assert "data: [DONE]" in replays[0].text


def test_a_lease_resumed_on_the_gateway_its_client_left_is_still_refreshed(redis_server: Any) -> None:
    """The client leaves and resumes through the same gateway: when the first grace
    ends (resumed: hand over), the lease must still be kept alive for the resumed
    request, and dropped when that one ends."""
    limits = Limits(max_concurrent=1)
    broker = RedisBroker(redis_server.url, model="x", cfg=RedisConfig(limit_lease_s=LEASE_S))

    async def go() -> tuple[bool, bool]:
        lim = broker.limiter()
        assert (await lim.acquire("fay", limits, "r", 0)).allowed  # started
        assert (await lim.acquire("fay", limits, "r", 0)).allowed  # left, then resumed here
        lim.hand_over("fay", "r")  # the first grace ends: it was resumed
        await asyncio.sleep(LEASE_S + 1)
        held = not (await lim.acquire("fay", limits, "other", 0)).allowed
        await lim.release("fay", limits, "r", 0)  # the resumed request ends
        freed = (await lim.acquire("fay", limits, "other", 0)).allowed
        await lim.release("fay", limits, "other", 0)
        await lim.aclose()
        return held, freed

    try:
        assert asyncio.run(go()) == (True, True)
    finally:
        broker.close()
