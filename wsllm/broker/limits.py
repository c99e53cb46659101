"""Per-tenant rate limits: the `Limiter` contract and its in-process implementation.

A tenant has up to three limits (`Limits`; None = unlimited):

- `rpm` and `tpm`: token buckets that refill continuously, `capacity` per minute, so a
  full bucket holds one minute's worth. A request takes 1 from the requests bucket and
  its token charge from the tokens bucket; both are checked and taken together, or not
  at all.
- `max_concurrent`: requests of the tenant in flight at once. Each admitted request
  holds a lease (by request id) until `release`. A request that holds a lease already
  (a client resuming its own request) does not count against itself.

The gateway refuses a token charge larger than the whole bucket before asking the
limiter (`quota.py`: it could never pass). A charge is taken before the gateway knows
the prompt's length (a coarse one) and set right after tokenizing with `adjust`, which
may leave the bucket below zero: that debt is the estimate's error on a request already
prepared, and the tenant's next requests wait for it to refill (a debt is never
forgotten: on Redis a bucket expires only once it would be full). `release` hands back
the unused part of the charge (`refund`) and the lease.

The Redis implementation (`redis_limits.py`) does the same in one Lua script per
check, so that every gateway of a deployment shares the counters. The broker a gateway
runs on hands it the matching limiter (`Broker.limiter()`)."""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WINDOW_S = 60.0  # rpm and tpm are per minute: a bucket refills from empty in this long

REASON_REQUESTS = "requests"
REASON_TOKENS = "tokens"
REASON_CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # prompt + completion tokens per minute
    max_concurrent: int | None = None  # requests in flight at once

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrent is None


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one `acquire`. The remaining and reset figures are those of the
    buckets after the request (admitted) or now (refused); None where no limit applies."""

    allowed: bool
    reason: str | None = None  # the limit that refused it: requests | tokens | concurrent
    retry_after_s: float = 0.0  # when a retry can pass (refused only)
    charged: int = 0  # tokens taken from the tokens bucket
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None  # until the requests bucket is full again
    reset_tokens_s: float | None = None
    in_flight: int | None = None  # leases held (`usage` only)


def refill_time_s(level: float, capacity: int) -> float:
    """Seconds until a bucket at `level` is full."""
    return max(0.0, (capacity - level) * WINDOW_S / capacity)


class Limiter(abc.ABC):
    """Shared by every request of a gateway; call from the asyncio loop."""

    @abc.abstractmethod
    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int) -> Decision:
        """Check and take, atomically: one request, `tokens` tokens and a concurrency
        lease for `request_id` (each only where `limits` has that limit). A refused
        request takes nothing."""

    @abc.abstractmethod
    async def adjust(self, tenant: str, limits: Limits, tokens: int) -> float:
        """Take `tokens` more from the tokens bucket (a negative figure gives them
        back, up to its capacity). Never refuses: the bucket may go below zero.
        Returns its level after (0 without a tpm)."""

    @abc.abstractmethod
    async def usage(self, tenant: str, limits: Limits) -> Decision:
        """The tenant's buckets now (`allowed` True, nothing taken) and, in `in_flight`,
        its leases."""

    @abc.abstractmethod
    async def release(self, tenant: str, limits: Limits, request_id: str, refund: int) -> None:
        """The request ended: drop its lease and give `refund` tokens back. Idempotent
        for the lease; call once per admitted request."""

    def hand_over(self, tenant: str, request_id: str) -> None:  # noqa: B027 - optional hook
        """This gateway stops keeping `request_id`'s lease alive without dropping it: a
        client resumed the request (perhaps through another gateway, which holds the
        lease from now on)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Stop background work (the app is stopping)."""


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float  # time.monotonic() of `level`

    def now(self, capacity: int, t: float) -> float:
        self.level = min(float(capacity), self.level + (t - self.at) * capacity / WINDOW_S)
        self.at = t
        return self.level


class MemoryLimiter(Limiter):
    """The limits of one gateway process (the memory broker's deployment). Nothing in
    `acquire` awaits, so a check and its take are atomic on the event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # bounded by the tenants of the keys file (and their in-flight requests)
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._inflight: dict[str, set[str]] = {}

    def _bucket(self, tenant: str, kind: str, capacity: int, t: float) -> _Bucket:
        b = self._buckets.get((tenant, kind))
        if b is None:
            b = self._buckets[(tenant, kind)] = _Bucket(float(capacity), t)
        b.now(capacity, t)
        return b

    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int) -> Decision:
        t = self._clock()
        rb = self._bucket(tenant, REASON_REQUESTS, limits.rpm, t) if limits.rpm else None
        tb = self._bucket(tenant, REASON_TOKENS, limits.tpm, t) if limits.tpm else None
        charge = tokens if limits.tpm else 0
        live = self._inflight.setdefault(tenant, set())
        reason, wait = None, 0.0
        held = request_id in live  # its own lease (a resume) does not count against it
        if limits.max_concurrent is not None and not held and len(live) >= limits.max_concurrent:
            reason, wait = REASON_CONCURRENT, 1.0  # a lease ends when a request does: no schedule
        elif rb is not None and limits.rpm and rb.level < 1:
            reason, wait = REASON_REQUESTS, (1 - rb.level) * WINDOW_S / limits.rpm
        elif tb is not None and limits.tpm and tb.level < charge:
            reason, wait = REASON_TOKENS, (charge - tb.level) * WINDOW_S / limits.tpm
        if reason is None:
            if rb is not None:
                rb.level -= 1
            if tb is not None:
                tb.level -= charge
            if limits.max_concurrent is not None:
                live.add(request_id)
        if not live:
            self._inflight.pop(tenant, None)
        return Decision(
            allowed=reason is None,
            reason=reason,
            retry_after_s=wait,
            charged=charge if reason is None and tb is not None else 0,
            **self._levels(rb, tb, limits),
        )

    @staticmethod
    def _levels(rb: _Bucket | None, tb: _Bucket | None, limits: Limits) -> dict[str, Any]:
        return dict(
            remaining_requests=None if rb is None else math.floor(rb.level),
            remaining_tokens=None if tb is None else math.floor(tb.level),
            reset_requests_s=None if rb is None or not limits.rpm else refill_time_s(rb.level, limits.rpm),
            reset_tokens_s=None if tb is None or not limits.tpm else refill_time_s(tb.level, limits.tpm),
        )

    async def adjust(self, tenant: str, limits: Limits, tokens: int) -> float:
        if not limits.tpm:
            return 0.0
        b = self._bucket(tenant, REASON_TOKENS, limits.tpm, self._clock())
        b.level = min(float(limits.tpm), b.level - tokens)
        return b.level

    async def usage(self, tenant: str, limits: Limits) -> Decision:
        t = self._clock()
        rb = self._bucket(tenant, REASON_REQUESTS, limits.rpm, t) if limits.rpm else None
        tb = self._bucket(tenant, REASON_TOKENS, limits.tpm, t) if limits.tpm else None
        return Decision(allowed=True, in_flight=self.in_flight(tenant), **self._levels(rb, tb, limits))

    async def release(self, tenant: str, limits: Limits, request_id: str, refund: int) -> None:
        live = self._inflight.get(tenant)
        if live is not None:
            live.discard(request_id)
            if not live:
                del self._inflight[tenant]
        if refund > 0 and limits.tpm:
            b = self._bucket(tenant, REASON_TOKENS, limits.tpm, self._clock())
            b.level = min(float(limits.tpm), b.level + refund)

    def in_flight(self, tenant: str) -> int:
        return len(self._inflight.get(tenant, ()))
