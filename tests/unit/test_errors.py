"""`errors.from_broker`: the one mapping from a broker error to the answer every
transport gives (HTTP status, error code, Retry-After)."""

from __future__ import annotations

import pytest

from wsllm.broker.base import BrokerClosed, BrokerError, BrokerUnavailable, QueueFull
from wsllm.server.errors import from_broker


@pytest.mark.parametrize(
    ("error", "status", "code", "says"),
    [
        (QueueFull("the queue is full"), 429, "queue_full", "the server is busy: the queue is full"),
        (BrokerClosed(), 503, "model_not_ready", "shutting down"),
        (BrokerUnavailable("connection refused"), 503, "model_not_ready", "unreachable"),
        (BrokerError("X cannot resume requests"), 503, "model_not_ready", "cannot resume"),
    ],
)
def test_every_broker_error_is_a_retry_later(error: BrokerError, status: int, code: str, says: str) -> None:
    e = from_broker(error)
    assert (e.status, e.code, e.retry_after) == (status, code, 1)
    assert says in e.message
    assert e.response().headers["retry-after"] == "1"
