"""A repeated conversation hits the prefix cache, and /metrics shows it."""

from __future__ import annotations

import time
from typing import Any

import httpx


def test_second_turn_reports_cached_tokens_and_hit_rate(tiny_server: Any) -> None:
    system = "You are a patient assistant who explains things step by step. " * 12
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as c:
        first = c.post("/v1/chat/completions", json=body).json()
        second = c.post("/v1/chat/completions", json=body).json()
    assert first["usage"]["prompt_tokens"] > 100
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 96, second["usage"]
    deadline = time.time() + 10
    while time.time() < deadline and tiny_server.metric("wsllm_prefix_cache_hit_rate") <= 0:
        time.sleep(0.2)  # gauges follow the engine's heartbeat
    assert 0 < tiny_server.metric("wsllm_prefix_cache_hit_rate") <= 1
