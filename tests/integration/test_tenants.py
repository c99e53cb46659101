"""Tenants on a live gateway (memory broker, tiny model): a tenant over its tpm or rpm
gets 429 `rate_limited` with Retry-After and OpenAI's x-ratelimit-* headers while
another tenant goes on; a max_concurrent lease ends when its client disconnects or
cancels; on the WebSocket a refused request gets an `error` with `retry_after_s` and
the socket goes on; a tenant limited to other models gets 404, and sees none of the
model's figures on /metrics; the prefix cache is sealed per tenant (`cached_tokens`
never counts another tenant's blocks), narrowed by a request's `cache_salt`, shared
between tenants the keys file gives one salt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets

KEYS = """
[tenants.alice]
keys = ["sk-alice"]
tpm = 300

[tenants.bob]
keys = ["sk-bob"]
rpm = 1000
tpm = 100000
max_priority = 10

[tenants.carol]
keys = ["sk-carol"]
rpm = 2

[tenants.dave]
keys = ["sk-dave"]
max_concurrent = 1

[tenants.eve]
keys = ["sk-eve"]
models = ["other-*"]

[tenants.gina]
keys = ["sk-gina"]
cache_salt = "team"

[tenants.hank]
keys = ["sk-hank"]
cache_salt = "team"
"""

HEADERS = ("limit", "remaining", "reset")


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any, tmp_path_factory: Any) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with live_server(tiny_engine, api_keys_file=str(path), api_key="sk-admin") as s:
        yield s


def client(srv: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0)


def post(srv: Any, key: str, **body: Any) -> httpx.Response:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0} | body
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers, timeout=60)


def test_a_tenant_over_its_tpm_gets_429_while_another_goes_on(srv: Any) -> None:
    alice, bob = client(srv, "sk-alice"), client(srv, "sk-bob")
    limited = srv.metric("wsllm_tenant_rate_limited_total", tenant="alice", model=srv.gateway.model_name)
    bob_tokens = srv.metric("wsllm_tenant_tokens_total", tenant="bob")
    bob_used = 0
    # 4 prompt tokens + 200 max_tokens are charged at admission: 204 of alice's 300.
    first = alice.completions.with_raw_response.create(
        model=srv.gateway.model_name, prompt=[5, 6, 7, 8], max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert first.headers["x-ratelimit-limit-tokens"] == "300"
    assert "x-ratelimit-limit-requests" not in first.headers  # alice has no rpm
    # It used all 200: nothing comes back, and 204 more do not fit in what is left.
    with pytest.raises(openai.RateLimitError) as e:
        alice.completions.create(model=srv.gateway.model_name, prompt=[5, 6, 7, 8], max_tokens=200)
    r = e.value.response
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "rate_limited" and err["type"] == "rate_limit_error" and "alice" in err["message"]
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 204
    assert r.headers["x-ratelimit-reset-tokens"].endswith(("s", "ms"))
    for _ in range(3):  # bob is not touched by alice's limit
        ok = bob.completions.with_raw_response.create(model=srv.gateway.model_name, prompt="hi", max_tokens=4)
        assert ok.parse().choices[0].finish_reason in ("length", "stop")
        assert {f"x-ratelimit-{h}-{w}" for h in HEADERS for w in ("requests", "tokens")} <= set(ok.headers)
        bob_used += ok.parse().usage.total_tokens  # type: ignore[union-attr]
    # A small request still fits alice's remaining tokens.
    assert post(srv, "sk-alice", max_tokens=4).status_code == 200
    # per-tenant metrics, labelled by the keys file's names and the model
    assert (
        srv.metric("wsllm_tenant_rate_limited_total", tenant="alice", model=srv.gateway.model_name)
        == limited + 1
    )
    deadline = time.monotonic() + 10  # completion tokens are counted when a request lets go of its lease
    while srv.metric("wsllm_tenant_tokens_total", tenant="bob") != bob_tokens + bob_used:
        assert time.monotonic() < deadline, (
            srv.metric("wsllm_tenant_tokens_total", tenant="bob"),
            bob_tokens,
            bob_used,
        )
        time.sleep(0.05)


def test_rpm(srv: Any) -> None:
    codes = [post(srv, "sk-carol").status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = post(srv, "sk-carol")
    assert r.json()["error"]["code"] == "rate_limited"
    assert (
        r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    )
    assert 1 <= int(r.headers["retry-after"]) <= 30  # 1 request at 2 per minute: 30 s at most


def wait_released(srv: Any, tenant: str, timeout: float = 10.0) -> None:
    limiter = srv.gateway.limiter
    deadline = time.monotonic() + timeout
    while limiter.in_flight(tenant):
        assert time.monotonic() < deadline, "the concurrency lease was not released"
        time.sleep(0.01)


def test_max_concurrent_is_released_when_the_client_disconnects(srv: Any) -> None:
    long = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"authorization": "Bearer sk-dave"}
    with (
        httpx.Client(base_url=srv.base_url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=long) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("id: ")  # it runs
        second = post(srv, "sk-dave")
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limited"
        assert int(second.headers["retry-after"]) >= 1
    # the client left mid-stream: its lease ends with it
    wait_released(srv, "dave")
    assert post(srv, "sk-dave").status_code == 200
    wait_released(srv, "dave")


def test_websocket_rate_limited_error_keeps_the_socket(srv: Any) -> None:
    async def go() -> list[dict[str, Any]]:
        url = srv.ws_url
        async with websockets.connect(url, additional_headers={"authorization": "Bearer sk-dave"}) as ws:
            await ws.recv()  # hello

            async def send(msg: dict[str, Any]) -> None:
                await ws.send(orjson.dumps(msg).decode())

            async def until(pred: Any) -> dict[str, Any]:
                while True:
                    m = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
                    if pred(m):
                        return dict(m)

            long = {"type": "completion", "prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True}
            await send(long | {"id": "a"})
            await until(lambda m: m["type"] == "delta" and m["id"] == "a")
            await send({"type": "completion", "id": "b", "prompt": "hi", "max_tokens": 2})
            refused = await until(lambda m: m["id"] == "b")
            await send({"type": "cancel", "id": "a"})
            cancelled = await until(lambda m: m["type"] == "done" and m["id"] == "a")
            await asyncio.to_thread(wait_released, srv, "dave")
            await send({"type": "completion", "id": "c", "prompt": "hi", "max_tokens": 2})
            done = await until(lambda m: m["id"] == "c" and m["type"] in ("done", "error"))
            await send({"type": "ping"})
            pong = await until(lambda m: m["type"] == "pong")
            return [refused, cancelled, done, pong]

    refused, cancelled, done, pong = asyncio.run(go())
    assert refused["type"] == "error" and refused["code"] == "rate_limited"
    assert isinstance(refused["retry_after_s"], int) and refused["retry_after_s"] >= 1
    assert cancelled["finish_reason"] == "abort"
    assert done["type"] == "done" and pong == {"type": "pong"}


def test_models_outside_a_tenants_list_are_not_found(srv: Any) -> None:
    r = post(srv, "sk-eve")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_api_key_is_one_unlimited_tenant_and_keys_are_checked(srv: Any) -> None:
    ok = post(srv, "sk-admin")
    assert ok.status_code == 200 and not any(h.startswith("x-ratelimit") for h in ok.headers)
    assert post(srv, "sk-nobody").status_code == 401


def test_priority_is_capped_per_key_and_the_engine_accounts_tokens_to_the_tenant(srv: Any) -> None:
    assert post(srv, "sk-bob", priority=10).status_code == 200
    over = post(srv, "sk-bob", priority=11)
    assert over.status_code == 400 and over.json()["error"]["param"] == "priority"
    assert "at most 10" in over.json()["error"]["message"]
    # Without a max_priority a key gets --max-priority (0): it may lower its own priority only.
    assert post(srv, "sk-admin", priority=-3).status_code == 200
    assert post(srv, "sk-admin", priority=1).status_code == 400
    served = srv.engine.scheduler.served  # the engine shares its batch by these names
    assert served.get("bob", 0) > 0 and served.get("default", 0) > 0


def test_metrics_show_a_key_only_the_models_it_may_use(srv: Any) -> None:
    """/metrics told any key every model's traffic and cache hit rate; a key sees the
    models it may use, an operator every model and the tenants."""
    assert post(srv, "sk-bob").status_code == 200  # traffic on the model

    def page(key: str) -> str:
        r = httpx.get(f"{srv.base_url}/metrics", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200
        return r.text

    served = f'model="{srv.gateway.model_name}"'
    assert served in page("sk-bob") and served in page("sk-admin")
    eve = page("sk-eve")  # may use other-* only
    assert "# TYPE wsllm_prompt_tokens_total counter" in eve and served not in eve, eve
    assert 'tenant="' not in eve and 'tenant="' not in page("sk-bob") and 'tenant="bob"' in page("sk-admin")


def test_cached_tokens_never_count_another_tenants_blocks(srv: Any) -> None:
    """The probe: a key that guessed another tenant's prompt got `cached_tokens` 32 for
    the right guess and 0 for a wrong one. A tenant's chain starts from its own salt."""
    prompt = list(range(400, 480))  # five blocks of 16

    def cached(key: str, **body: Any) -> int:  # (2 tokens: a request ended by its prefill caches nothing)
        r = post(srv, key, prompt=prompt, max_tokens=2, **body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("sk-bob") == 0
    assert cached("sk-bob") >= 64  # its own prompt again: a hit
    assert cached("sk-admin") == 0  # the right guess of another tenant: nothing
    assert cached("sk-admin") >= 64  # ...that now caches it for itself
    assert cached("sk-bob", cache_salt="s1") == 0  # a request's salt narrows its tenant's
    assert cached("sk-bob", cache_salt="s1") >= 64
    assert cached("sk-gina") == 0  # an operator's salt, shared on purpose
    assert cached("sk-hank") >= 64
    too_long = post(srv, "sk-bob", cache_salt="x" * 257)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "cache_salt"
