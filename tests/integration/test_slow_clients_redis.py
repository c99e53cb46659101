"""A client that never reads, on the Redis deployment (the `redis_deployment` fixture):
gateway B, a child process whose memory is measured, stays bounded while the client's
requests pile up events behind it, drops the client after --send-timeout-s, and its
requests are cancelled with every KV block freed. The in-process cases:
tests/integration/test_slow_clients.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
from bodies import completion
from rawclients import ws_connect, ws_send
from redis_fixtures import Deployment, sse_text


def test_a_client_that_never_reads_leaves_the_gateway_memory_bounded(redis_deployment: Deployment) -> None:
    dep = redis_deployment
    asyncio.run(sse_text(dep.b, completion([1, 2], 20, logprobs=20, n=8)))  # warm: code paths, caches
    before = dep.gateway_b_rss()
    timeouts = metric(dep.b, "wsllm_send_timeouts_total", 'transport="ws"')
    sock = ws_connect(dep.b)
    most = before
    try:
        for i in range(8):  # 8 requests x 8 choices x 2000 tokens, 20 logprobs each: ~300 MB of events
            ws_send(
                sock,
                {"type": "completion", "id": f"slow{i}"} | completion([70 + i, 1], 2000, n=8, logprobs=20),
            )
        deadline = time.monotonic() + 120
        while metric(dep.b, "wsllm_send_timeouts_total", 'transport="ws"') == timeouts:
            most = max(most, dep.gateway_b_rss())
            assert time.monotonic() < deadline, "the client that never reads was never dropped"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    grew = most - before
    print(
        f"gateway RSS: {before / 2**20:.0f} MiB before, at most {most / 2**20:.0f} MiB with the slow client"
    )
    assert grew < 96 * 2**20, f"the gateway grew by {grew / 2**20:.0f} MiB"
    dep.engine_idle()  # its requests were cancelled: every KV block is free


def metric(base: str, name: str, label: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
