"""A client that stops reading, on the in-process deployment: it is cut off after
--send-timeout-s with its KV blocks freed, and the gateway's buffers stay bounded
meanwhile, over the WebSocket and SSE. The same on Redis, measured on a gateway
process's memory: tests/integration/test_slow_clients_redis.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from bodies import completion
from rawclients import sse_post, ws_connect, ws_send

# A stalled reader is cut off by whichever comes first: --send-timeout-s without a byte
# taken, or --max-buffered-events piling up behind it. The tiny engine makes ~1000 events
# a second at n=8, so this buffer takes ~4 s to fill: the send timeout is what fires.
LIMITS = dict(
    send_timeout_s=0.5,
    max_buffered_events=4096,
    heartbeat_s=60.0,  # the WebSocket pings must not be what drops the silent clients here
)


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **LIMITS) as s:
        yield s


def _wait_metric(srv: Any, name: str, at_least: float, timeout: float = 30.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while (value := srv.metric(name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {value}"
        time.sleep(0.1)
    return value


def _watch_until_forgotten(srv: Any, n: int, timeout: float = 60.0) -> int:
    """Once the gateway follows `n` requests: until it follows none; returns the most
    events it buffered meanwhile."""
    most = 0
    deadline = time.monotonic() + timeout
    while len(srv.gateway.router.request_ids()) < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    while srv.gateway.router.request_ids():
        most = max(most, srv.gateway.router.buffered_events())
        assert time.monotonic() < deadline, f"the gateway still follows {srv.gateway.router.request_ids()}"
        time.sleep(0.01)
    return most


def test_a_websocket_client_that_never_reads_is_dropped_and_its_requests_freed(srv: Any) -> None:
    timeouts = srv.metric("wsllm_send_timeouts_total", transport="ws")
    sock = ws_connect(srv.base_url)
    try:
        for i in range(3):  # 3 x 8 choices x 2000 tokens with logprobs: far more than any buffer
            ws_send(sock, {"type": "completion", "id": f"s{i}"} | completion([7, i], 2000, n=8, logprobs=20))
        most = _watch_until_forgotten(srv, 3)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    assert most <= 3 * LIMITS["max_buffered_events"]  # type: ignore[operator]
    # the client is dropped once it has taken nothing for --send-timeout-s
    assert _wait_metric(srv, "wsllm_send_timeouts_total", timeouts + 1, transport="ws") == timeouts + 1
    srv.assert_no_blocks_held()


def test_an_sse_client_that_never_reads_is_dropped_and_its_request_freed(srv: Any) -> None:
    timeouts = srv.metric("wsllm_send_timeouts_total", transport="sse")
    sock = sse_post(srv.base_url, "/v1/completions", completion([9, 9], 2000, n=8, logprobs=20))
    try:
        most = _watch_until_forgotten(srv, 1)
    finally:
        sock.close()
    assert most <= LIMITS["max_buffered_events"]  # type: ignore[operator]
    assert _wait_metric(srv, "wsllm_send_timeouts_total", timeouts + 1, transport="sse") == timeouts + 1
    srv.assert_no_blocks_held()
