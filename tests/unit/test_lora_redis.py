"""LoRA adapters across a Redis deployment (one instance, and a Redis Cluster), with two real
tiny engines that hold different adapters: each request for an adapter is served by an
engine that holds it (the other never takes it, however idle), base requests by either;
an operator's load reaches every engine of the model and each answers, after which the
new adapter's requests go to the engines that loaded it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wsllm.broker.redis import RedisBroker
from wsllm.config import EngineConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.types import AdapterCommand, GenerateRequest, SamplingParams, TokenEvent


@pytest.fixture(scope="module")
def adapter_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, lora_factory: Any
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-redis")
    return {
        n: lora_factory(root / n, tiny_model_dir, s, r=2, targets=("q_proj",))
        for n, s in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> list[Any]:
    from wsllm.engine.engine import LLMEngine

    return [
        LLMEngine.from_config(
            EngineConfig(
                model=str(tiny_model_dir),
                num_kv_blocks=64,
                max_num_seqs=4,
                dtype="float32",
                lora=[f"{name}={adapter_dirs[name]}"],
                allow_adapter_dir=str(adapter_dirs[name].parent),
            )
        )  # fmt: skip
        for name in ("a", "b")
    ]


@pytest.fixture
def rig(
    any_redis: Any, engines: list[Any]
) -> Iterator[tuple[RedisBroker, list[EngineWorker], list[list[TokenEvent]]]]:
    any_redis.client().flushall()
    cfg = RedisConfig(steal_after_s=0.05, routing="prefix")
    gw = RedisBroker(any_redis.url, model="m", cfg=cfg)
    sides = [RedisBroker(any_redis.url, model="m", cfg=cfg, engine_id=f"e{i}") for i in range(2)]
    served: list[list[TokenEvent]] = [[], []]
    workers = [
        EngineWorker(e, s, engine_id=f"e{i}", idle_wait_s=0.0)
        for i, (e, s) in enumerate(zip(engines, sides, strict=True))
    ]
    for w, got in zip(workers, served, strict=True):
        w.on_publish = got.extend
        w.run_once()  # its first heartbeat: the registry, and its taker, know its adapters
    yield gw, workers, served
    for w in workers:
        w.drain()
    for b in [gw, *sides]:
        b.close()


def ask(gw: RedisBroker, rid: str, lora: str) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    req = GenerateRequest(rid, [5, 6, 7, 8], p, model="m", arrival_time=time.time(), lora=lora)
    asyncio.run(gw.submit(req))


def finished(events: list[TokenEvent]) -> set[str]:
    return {e.request_id for e in events if e.finish_reason}


def test_each_adapter_request_is_served_by_an_engine_that_holds_it(rig: Any) -> None:
    gw, (w0, w1), (by0, by1) = rig
    for i in range(3):
        ask(gw, f"a{i}", "a")
        ask(gw, f"b{i}", "b")
    ask(gw, "base", "")
    for _ in range(12):  # e1 (adapter b) runs alone first: it never takes a request for a
        w1.run_once()
    assert finished(by1) >= {"b0", "b1", "b2"} and not any(e.request_id.startswith("a") for e in by1)
    for _ in range(12):
        w0.run_once()
        w1.run_once()
    assert finished(by0) | finished(by1) == {"a0", "a1", "a2", "b0", "b1", "b2", "base"}
    assert {r for r in finished(by0) if r != "base"} == {"a0", "a1", "a2"}
    assert not any(e.error_code for e in by0 + by1)


def test_a_load_reaches_every_engine_and_routes_the_new_adapter(
    rig: Any, adapter_dirs: dict[str, Path]
) -> None:
    gw, (w0, w1), (by0, by1) = rig
    for w in (w0, w1):
        w.start()
    try:
        cmd = AdapterCommand("cmd-1", "load", "c", str(adapter_dirs["a"]))
        replies = asyncio.run(gw.command("m", cmd, 2, timeout=30.0))
        assert sorted((r.engine_id, r.status) for r in replies) == [("e0", 200), ("e1", 200)]
        infos = asyncio.run(gw.engines())
        assert sorted(sorted(i.adapters) for i in infos) == [["a", "c"], ["b", "c"]]
        ask(gw, "c0", "c")
        deadline = time.monotonic() + 30
        while "c0" not in finished(by0) | finished(by1):
            assert time.monotonic() < deadline, "the request for c was not served"
            time.sleep(0.01)
        bad = AdapterCommand("cmd-2", "unload", "b")
        replies = asyncio.run(gw.command("m", bad, 2, timeout=30.0))
        assert sorted((r.engine_id, r.status) for r in replies) == [("e0", 404), ("e1", 200)]
    finally:
        for w in (w0, w1):
            w.stop()
        for e in w0.engine, w1.engine:  # leave them as the module found them
            for name in set(e.adapters.names()) - {"a", "b"}:
                e.adapters.unload(name)
        if "b" not in w1.engine.adapters.names():
            w1.engine.adapters.load("b", str(adapter_dirs["b"]))
