"""Prefix-aware routing on Redis, with two real (tiny, random) engines stepped by hand:
a conversation that resends its history lands on the engine that holds its prefix
(and hits its cache there), the other engine leaves it alone, routing reads the keys
of the request's own namespace (its tenant's salt) as the engine files them, and a
request routed to a busy engine is taken by an idle one after the steal delay."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wsllm.broker.prefix_routing import pack, unpack
from wsllm.broker.redis import RedisBroker
from wsllm.config import EngineConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.block_manager import BlockManager
from wsllm.engine.worker import EngineWorker
from wsllm.prefix_hash import SUMMARY_BYTES, prompt_keys, request_images, request_root
from wsllm.types import GenerateRequest, PromptImage, SamplingParams, TokenEvent


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> list[Any]:
    from wsllm.engine.engine import LLMEngine

    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=4, dtype="float32")
    return [LLMEngine.from_config(cfg) for _ in range(2)]


@pytest.fixture
def rig(
    any_redis: Any, engines: list[Any]
) -> Iterator[tuple[RedisBroker, list[EngineWorker], list[TokenEvent]]]:
    any_redis.client().flushall()
    cfg = RedisConfig(steal_after_s=30.0, routing="prefix")
    gw = RedisBroker(any_redis.url, model="m", cfg=cfg)
    sides = [RedisBroker(any_redis.url, model="m", cfg=cfg, engine_id=f"e{i}") for i in range(2)]
    events: list[TokenEvent] = []
    workers = [
        EngineWorker(e, s, engine_id=f"e{i}", idle_wait_s=0.0)
        for i, (e, s) in enumerate(zip(engines, sides, strict=True))
    ]
    for w in workers:
        w.on_publish = events.extend
    yield gw, workers, events
    for w in workers:
        w.drain()
    for b in [gw, *sides]:
        b.close()


def ask(gw: RedisBroker, rid: str, prompt: list[int], salt: str = "") -> None:
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    request = GenerateRequest(rid, prompt, p, model="m", arrival_time=time.time(), cache_salt=salt)
    asyncio.run(gw.submit(request))


def serve(worker: EngineWorker, events: list[TokenEvent], rid: str) -> list[int]:
    """Step `worker` until `rid` ends; its tokens."""
    for _ in range(100):
        worker.run_once()
        if any(e.request_id == rid and e.finish_reason for e in events):
            return [t for e in events if e.request_id == rid for t in e.token_ids]
    raise AssertionError(f"{rid} did not end on {worker.engine_id}")


def test_a_resent_conversation_lands_on_the_engine_holding_its_prefix(rig: Any) -> None:
    gw, (w0, w1), events = rig
    chat = list(range(100, 180))  # five blocks of 16
    ask(gw, "turn1", chat)
    reply = serve(w0, events, "turn1")  # nobody holds it yet: e0 takes it
    ask(gw, "other", list(range(300, 340)))
    serve(w1, events, "other")  # e1 holds something else
    hits_before = w0.engine.block_manager.hit_tokens
    ask(gw, "turn2", chat + reply + [7, 8, 9])
    for _ in range(5):
        w1.run_once()  # it is not e1's to take: it waits for e0
    assert not any(e.request_id == "turn2" for e in events)
    serve(w0, events, "turn2")
    assert w0.engine.block_manager.hit_tokens - hits_before >= 64  # the history came from its cache


def test_routing_and_the_cache_use_the_requests_namespace(rig: Any) -> None:
    """A tenant's blocks are filed under its salt: its next turn is routed to them and
    hits them; the same tokens under another tenant's salt are nobody's prefix."""
    gw, (w0, w1), events = rig
    chat = random.Random().sample(range(1000, 20000), 80)  # new to the engines (each param's run)
    ask(gw, "a1", chat, salt="tenant:a")
    reply = serve(w0, events, "a1")
    ask(gw, "b1", chat + reply, salt="tenant:b")  # another tenant's right guess
    b_hits = w1.engine.block_manager.hit_tokens
    assert serve(w1, events, "b1")  # nobody holds its prefix: the idle engine takes it
    assert w1.engine.block_manager.hit_tokens == b_hits
    ask(gw, "a2", chat + reply + [7], salt="tenant:a")
    for _ in range(5):
        w1.run_once()  # e1 holds b's blocks of the same tokens, not a's: it waits for e0
    assert not any(e.request_id == "a2" for e in events)
    hits = w0.engine.block_manager.hit_tokens
    serve(w0, events, "a2")
    assert w0.engine.block_manager.hit_tokens - hits >= 64


def test_a_request_for_a_busy_engine_is_taken_by_an_idle_one(any_redis: Any) -> None:
    any_redis.client().flushall()
    cfg = RedisConfig(steal_after_s=1.0, routing="prefix")
    gw = RedisBroker(any_redis.url, model="m", cfg=cfg)
    busy, idle = (RedisBroker(any_redis.url, model="m", cfg=cfg, engine_id=e) for e in ("busy", "idle"))
    try:
        prompt = list(range(1, 70))
        busy.publish_prefix(16, prompt_keys(prompt, 16))
        idle.publish_prefix(16, [])
        ask(gw, "r", prompt)
        t0 = time.monotonic()
        assert idle.pull(4, timeout=0.2) == []  # routed to "busy", which pulls nothing now
        got = idle.pull(4, timeout=3.0)
        assert [r.request_id for r in got] == ["r"] and time.monotonic() - t0 >= 0.95
    finally:
        for b in (gw, busy, idle):
            b.close()


def test_the_summary_is_the_block_managers_own_chain() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(1, 14))
    bm.allocate(1, tokens)
    bm.register_computed(1, tokens, len(tokens))
    size, held = unpack(pack(4, bm.cached_keys(100)))
    assert size == 4 and [k[:SUMMARY_BYTES] in held for k in prompt_keys(tokens + [99], 4)] == [True] * 3


def test_routing_keys_a_prompt_with_an_image_as_the_block_manager_does() -> None:
    """The gateway's keys of a prompt with an image (`request_images`) are the block
    manager's; without the image's span they would be other blocks' keys."""
    image = PromptImage.of(b"a picture", "c" * 64, 2, 6)
    tokens = list(range(1, 14))
    request = GenerateRequest("r", [*tokens, 99], SamplingParams(), images=[image])
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate(1, tokens, images=request_images(request))
    bm.register_computed(1, tokens, len(tokens))
    _, held = unpack(pack(4, bm.cached_keys(100)))
    keys = prompt_keys(request.prompt_token_ids, 4, request_root(request), request_images(request))
    assert [k[:SUMMARY_BYTES] in held for k in keys] == [True] * 3
    assert not any(k[:SUMMARY_BYTES] in held for k in prompt_keys(request.prompt_token_ids, 4))
