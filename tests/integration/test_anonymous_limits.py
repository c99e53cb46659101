"""The anonymous tenant (a gateway that requires no key) has limits, settable in
GatewayConfig: past its rpm a keyless client gets 429 with OpenAI's headers; being
the only tenant there, it sees its own figures on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, anonymous_rpm=3, anonymous_max_concurrent=2) as s:
        yield s


def test_keyless_clients_share_the_anonymous_limits(srv: Any) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    url = f"{srv.base_url}/v1/completions"
    answers = [httpx.post(url, json=body, timeout=60) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[3].json()["error"]["code"] == "rate_limited" and "anonymous" in answers[3].text
    page = httpx.get(f"{srv.base_url}/metrics").text
    assert 'tenant="anonymous"' in page
