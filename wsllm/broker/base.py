"""The broker contract: how requests reach engines and TokenEvents come back.

Two sides share one object:

- the gateway (asyncio) calls `submit`, `abort`, and iterates `events()`; it reads
  `engines()` to know whether anything can serve it (`/ready`, gauges, limits);
- an engine worker (a plain thread or process, no asyncio) calls `pull`, `aborts`,
  `publish` and `heartbeat`.

A gateway-side call never blocks the event loop for long; an engine-side call may
block, always with a timeout, so that the worker can notice it was asked to stop.
The memory broker and the Redis broker implement this same contract and pass the same
tests (tests/unit/test_broker_contract.py).
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from wsllm.types import GenerateRequest, TokenEvent


class BrokerError(Exception):
    """Base class of the errors a broker raises to the gateway."""


class QueueFull(BrokerError):
    """Too many requests wait for an engine; the gateway answers 429 with Retry-After."""


class BrokerClosed(BrokerError):
    """The broker was closed; nothing more goes through it."""


@dataclass(slots=True)
class EngineInfo:
    """What an engine worker tells the gateways about itself, refreshed by heartbeats."""

    engine_id: str
    model: str
    max_model_len: int
    # num_running, num_waiting, kv_usage, num_free_blocks, ... (engine.stats())
    stats: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0  # time.time() of the last heartbeat

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineInfo:
        return cls(**d)


class Broker(abc.ABC):
    """One broker object per process side. See the module docstring."""

    #: an engine whose last heartbeat is older than this is not counted as alive
    engine_ttl_s: float = 10.0

    # -- gateway side (call from the asyncio loop) ---------------------------------

    @abc.abstractmethod
    async def submit(self, request: GenerateRequest) -> None:
        """Queue `request` for an engine. Raises QueueFull when too many wait, and
        BrokerClosed after close(). Never waits for an engine to take it."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop `request_id` wherever it is: still queued (it is dropped) or running
        in an engine (the engine frees its blocks within one step). Idempotent."""

    @abc.abstractmethod
    def events(self) -> AsyncIterator[list[TokenEvent]]:
        """Batches of TokenEvents meant for this gateway, in publish order. One
        consumer per gateway: the app's reader task. Ends when the broker closes."""

    @abc.abstractmethod
    async def engines(self) -> list[EngineInfo]:
        """Engines seen within `engine_ttl_s`."""

    async def pending(self) -> int:
        """Requests submitted and not yet pulled by an engine (best effort)."""
        return 0

    # -- engine side (call from a worker thread or process) ------------------------

    @abc.abstractmethod
    def pull(self, max_n: int, timeout: float = 0.0) -> list[GenerateRequest]:
        """Take up to `max_n` queued requests, oldest first. Waits up to `timeout`
        seconds for the first one; returns [] when none came."""

    @abc.abstractmethod
    def aborts(self) -> list[str]:
        """Request ids aborted since the last call (each at most once). Never blocks."""

    @abc.abstractmethod
    def publish(self, events: list[TokenEvent]) -> None:
        """Send one engine step's events to the gateways waiting for them. May block
        while the gateway side is full (backpressure), never forever."""

    @abc.abstractmethod
    def heartbeat(self, info: EngineInfo) -> None:
        """Register the engine or refresh it (its stats and `last_seen`)."""

    def deregister(self, engine_id: str) -> None:  # noqa: B027 - optional hook
        """The engine leaves cleanly; gateways stop counting it at once."""

    # -- both ----------------------------------------------------------------------

    @abc.abstractmethod
    def close(self) -> None:
        """Stop everything: events() ends, pull() returns [], submit() raises."""

    def _alive(self, infos: list[EngineInfo]) -> list[EngineInfo]:
        now = time.time()
        return [i for i in infos if now - i.last_seen <= self.engine_ttl_s]
