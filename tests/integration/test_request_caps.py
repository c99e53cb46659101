"""The per-request caps, on the in-process deployment: a chat of more messages than
--max-messages is refused by count however small each is (the per-socket cap, for
every kind of request, is test_admission_first.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

CAPS = dict(max_messages=64)


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **CAPS) as s:
        yield s


def test_a_body_of_many_tiny_messages_is_refused_by_count(srv: Any) -> None:
    many = {"messages": [{"role": "user", "content": ""}] * 36000}
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=many, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "at most 64 messages" in r.json()["error"]["message"]
    ok = httpx.post(
        f"{srv.base_url}/v1/chat/completions", json={"messages": many["messages"][:64], "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text
