"""A tenant's limits at admission: take from its buckets (or refuse with 429), and the
`x-ratelimit-*` headers OpenAI sends.

The token charge of a request, taken when it is admitted, is its prompt tokens plus
`n x max_tokens`, where `max_tokens` is what the engine will use (the client's, or
`--default-max-tokens` capped by the room left in the model's context). When the
request ends in this gateway (finished, failed, cancelled, client gone) the unused
part, the charge minus the prompt and completion tokens it really used, goes back. A
request whose client left while it runs on for a resume (Redis) is not refunded: its
tokens are still being made. The rules of the buckets are in `wsllm/broker/limits.py`."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from wsllm.broker.base import BrokerError
from wsllm.broker.limits import REASON_CONCURRENT, REASON_REQUESTS, Decision, Limiter
from wsllm.server.errors import APIError
from wsllm.server.tenants import Tenant
from wsllm.types import ERR_RATE_LIMITED

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `250ms`, `12s`, `1m30s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def ratelimit_headers(tenant: Tenant, d: Decision) -> dict[str, str]:
    """`x-ratelimit-*` for the limits the tenant has (none for an unlimited one)."""
    out: dict[str, str] = {}
    lim = tenant.limits
    if lim.rpm is not None and d.remaining_requests is not None:
        out["x-ratelimit-limit-requests"] = str(lim.rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, d.remaining_requests))
        out["x-ratelimit-reset-requests"] = _duration(d.reset_requests_s or 0.0)
    if lim.tpm is not None and d.remaining_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(lim.tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, d.remaining_tokens))
        out["x-ratelimit-reset-tokens"] = _duration(d.reset_tokens_s or 0.0)
    return out


def refused(tenant: Tenant, d: Decision, tokens: int) -> APIError:
    lim = tenant.limits
    if d.reason == REASON_CONCURRENT:
        what = f"{lim.max_concurrent} requests at once"
    elif d.reason == REASON_REQUESTS:
        what = f"{lim.rpm} requests per minute"
    else:
        what = f"{lim.tpm} tokens per minute (this request is charged {min(tokens, lim.tpm or tokens)})"
    retry = max(1, math.ceil(d.retry_after_s))
    return APIError(
        429,
        ERR_RATE_LIMITED,
        f"rate limit reached for tenant {tenant.name!r}: {what}; retry in {retry}s",
        retry_after=retry,
        headers=ratelimit_headers(tenant, d),
    )


@dataclass(slots=True)
class Ticket:
    """What one admitted request took; `release` gives back what it did not use."""

    limiter: Limiter | None
    tenant: Tenant
    request_id: str
    decision: Decision
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False

    async def release(self, used_tokens: int | None) -> None:
        """The request ended here. `used_tokens` (prompt + completion) sets the refund;
        None: no refund (the request runs on without this gateway). Once only."""
        if self.released or self.limiter is None:
            self.released = True
            return
        self.released = True
        refund = 0 if used_tokens is None else max(0, self.decision.charged - used_tokens)
        try:
            await self.limiter.release(self.tenant.name, self.tenant.limits, self.request_id, refund)
        except BrokerError:  # the lease expires by itself (Redis); the refund is lost
            log.warning("could not release request %s of tenant %s", self.request_id, self.tenant.name)


async def admit(limiter: Limiter, tenant: Tenant, request_id: str, tokens: int) -> Ticket:
    """Take the request's share of the tenant's limits, or raise a 429 APIError."""
    if tenant.limits.unlimited:
        return Ticket(None, tenant, request_id, Decision(allowed=True))
    d = await limiter.acquire(tenant.name, tenant.limits, request_id, tokens)
    if not d.allowed:
        raise refused(tenant, d, tokens)
    return Ticket(limiter, tenant, request_id, d, ratelimit_headers(tenant, d))
