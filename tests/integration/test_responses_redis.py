"""The Responses store shared through Redis: two gateways (each its own RedisBroker, in
this process) and one engine on the session's redis-server. A response stored through
one gateway is read, continued and deleted through the other, by its tenant's keys
only; a background response running on one gateway is cancelled through the other
(an abort through the broker, the end stored by the gateway that ran it), or deleted
there: it stops, and stays deleted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from wsllm.broker.redis import RedisBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.config_redis import RedisConfig
from wsllm.engine.worker import EngineWorker
from wsllm.server.app import create_app

KEYS = """
[tenants.alice]
keys = ["sk-alice"]

[tenants.bob]
keys = ["sk-bob"]
"""


def _ready(base: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", headers={"authorization": "Bearer sk-alice"}).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{base} did not become ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def gateways(
    redis_server: Any, tiny_engine: Any, tiny_model_dir: Path, uvicorn_thread: Any, tmp_path_factory: Any
) -> Iterator[tuple[str, str]]:
    redis_server.client().flushall()
    model = tiny_model_dir.name
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    engine_side = RedisBroker(redis_server.url, model=model, engine_id="engine-r")
    worker = EngineWorker(tiny_engine, engine_side, engine_id="engine-r", heartbeat_s=0.2)
    worker.start()
    brokers = [
        RedisBroker(redis_server.url, model=model, cfg=RedisConfig(resume_grace_s=1)) for _ in range(2)
    ]
    cfg = GatewayConfig(frontend=False, api_keys_file=str(keys))
    try:
        with (
            uvicorn_thread(lambda c: create_app(c, brokers[0], tiny_model_dir, model), cfg) as (a, _),
            uvicorn_thread(lambda c: create_app(c, brokers[1], tiny_model_dir, model), cfg) as (b, _),
        ):
            _ready(a)
            _ready(b)
            yield a, b
            deadline = time.monotonic() + 30  # what was cancelled or finished holds no KV
            while tiny_engine.has_unfinished():
                assert time.monotonic() < deadline, tiny_engine.stats()
                time.sleep(0.05)
            stats = tiny_engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks, stats
    finally:
        worker.stop()
        for br in [*brokers, engine_side]:
            br.close()


def client(base: str, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_a_stored_response_is_shared_by_the_gateways_for_its_tenant_only(gateways: tuple[str, str]) -> None:
    a, b = gateways
    first = client(a).responses.create(input="My name is Ada.", max_output_tokens=6, temperature=0)
    assert client(b).responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client(b, "sk-bob").responses.retrieve(first.id)
    second = client(b).responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client(a, "sk-bob").responses.delete(first.id)
    client(a).responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client(b).responses.retrieve(first.id)


def test_a_background_response_is_cancelled_through_another_gateway(gateways: tuple[str, str]) -> None:
    a, b = gateways
    r = client(a).responses.create(input="Go on and on.", background=True, max_output_tokens=2000)
    assert client(b).responses.retrieve(r.id).status == "in_progress"
    with pytest.raises(openai.NotFoundError):
        client(b, "sk-bob").responses.cancel(r.id)
    cancelled = client(b).responses.cancel(r.id)
    assert cancelled.status == "cancelled", cancelled.status
    assert client(a).responses.retrieve(r.id).status == "cancelled"


def test_a_background_response_deleted_through_another_gateway_stops_and_stays_deleted(
    gateways: tuple[str, str], tiny_engine: Any
) -> None:
    a, b = gateways
    r = client(a).responses.create(input="Go on and on.", background=True, max_output_tokens=2000)
    engine_request = "resp-" + r.id.removeprefix("resp_")
    client(b).responses.delete(r.id)
    for base in (a, b):
        with pytest.raises(openai.NotFoundError):
            client(base).responses.retrieve(r.id)
    deadline = time.monotonic() + 10
    while tiny_engine.is_known(engine_request):
        assert time.monotonic() < deadline, "the deleted background response still runs"
        time.sleep(0.05)
    time.sleep(0.5)  # the run's end reached gateway a and was not stored
    with pytest.raises(openai.NotFoundError):
        client(a).responses.retrieve(r.id)
