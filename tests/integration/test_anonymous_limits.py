"""The anonymous tenant (a gateway that requires no key) has limits, settable in
GatewayConfig: past its max_concurrent or its rpm a keyless client gets 429 with
OpenAI's headers; being the only tenant there, it sees its own figures on /metrics; it
is not the operator (no adapter loads) unless `--anonymous-operator` says so."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

RPM, CONCURRENT = 6, 2
BODY = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, anonymous_rpm=RPM, anonymous_max_concurrent=CONCURRENT) as s:
        yield s


def test_keyless_clients_share_the_anonymous_concurrency(srv: Any) -> None:
    """`--anonymous-max-concurrent` streams at once; the next waits for one to end."""
    url = f"{srv.base_url}/v1/completions"
    long = BODY | {"max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", url, json=long) for _ in range(CONCURRENT)]
        lines = []
        for s in streams:
            r = s.__enter__()
            assert r.status_code == 200
            lines.append(r.iter_lines())  # kept: a dropped iterator closes the stream
            assert next(lines[-1]).startswith("id: ")  # it runs
        over = httpx.post(url, json=BODY, timeout=60)
        assert over.status_code == 429, over.text
        assert f"{CONCURRENT} requests at once" in over.json()["error"]["message"]
        streams[0].__exit__(None, None, None)  # one client leaves: its lease ends with it
        deadline = time.monotonic() + 10
        while srv.gateway.limiter.in_flight("anonymous") >= CONCURRENT:
            assert time.monotonic() < deadline, "the lease of the stream that left was not released"
            time.sleep(0.01)
        assert httpx.post(url, json=BODY, timeout=60).status_code == 200
        streams[1].__exit__(None, None, None)


def test_a_keyless_client_is_not_the_operator(srv: Any) -> None:
    """Anyone who reaches a keyless gateway would otherwise load an adapter from any path
    the engine can read."""
    body = {"lora_name": "x", "lora_path": "/etc"}
    r = httpx.post(f"{srv.base_url}/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    from wsllm.server.tenants import anonymous_tenant

    assert anonymous_tenant(0, 0, 0, operator=True).operator  # --anonymous-operator
    assert not anonymous_tenant(0, 0, 0).operator


def test_keyless_clients_share_the_anonymous_rpm(srv: Any) -> None:
    url = f"{srv.base_url}/v1/completions"
    first = httpx.post(url, json=BODY, timeout=60)
    assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == str(RPM)
    left = int(first.headers["x-ratelimit-remaining-requests"])
    answers = [httpx.post(url, json=BODY, timeout=60) for _ in range(left + 1)]
    assert [r.status_code for r in answers] == [200] * left + [429]
    assert answers[-1].json()["error"]["code"] == "rate_limited" and "anonymous" in answers[-1].text
    page = httpx.get(f"{srv.base_url}/metrics").text
    assert 'tenant="anonymous"' in page
