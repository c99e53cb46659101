"""The rate limits of `limits.py` kept in Redis, so that every gateway of a deployment
shares them. Each check-and-take is one Lua script (`lua/limit_acquire.lua`), so two gateways can never both take the last token.

`max_concurrent` is a sorted set of leases per tenant (request id scored by its
expiry), not a counter: a gateway that crashes leaves leases that expire after
`--limit-lease-s`, where a counter would stay high for ever. A gateway refreshes the
leases of its live requests every third of that time, and goes on refreshing the
lease of a request whose client left (it may be resumed) until its grace abort: the
lease is the request's, not the connection's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from wsllm.broker.base import BrokerUnavailable
from wsllm.broker.limits import WINDOW_S, Decision, Limiter, Limits, refill_time_s
from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_scripts import LIMIT_ACQUIRE, LIMIT_ADJUST, LIMIT_REFRESH, LIMIT_RELEASE, LIMIT_USAGE

log = logging.getLogger(__name__)

_WINDOW_MS = int(WINDOW_S * 1000)


class RedisLimiter(Limiter):
    def __init__(self, client: Callable[[], Any], keys: Keys, lease_s: float) -> None:
        self._client = client  # the gateway side's redis.asyncio client (one per loop)
        self.keys = keys
        self.lease_ms = max(1000, int(lease_s * 1000))
        # tenant -> its requests whose lease this gateway refreshes -> how many holders
        # here (a request resumed on the gateway its client left holds two)
        self._live: dict[str, dict[str, int]] = {}
        self._refresher: asyncio.Task[None] | None = None

    async def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await eval_script(self._client(), script, keys, args)
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None

    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int) -> Decision:
        k = self.keys
        charge = tokens if limits.tpm else 0
        args = [limits.rpm or 0, limits.tpm or 0, limits.max_concurrent or 0, charge]
        reply = await self._eval(
            LIMIT_ACQUIRE,
            [k.tenant(tenant, "rpm"), k.tenant(tenant, "tpm"), k.tenant(tenant, "live")],
            [*args, request_id, self.lease_ms, _WINDOW_MS],
        )
        reason = reply[0].decode() or None
        wait_ms, r, t = (float(x) for x in reply[1:])
        if reason is None and limits.max_concurrent is not None:
            live = self._live.setdefault(tenant, {})
            live[request_id] = live.get(request_id, 0) + 1
            self._start_refresher()
        return Decision(
            allowed=reason is None,
            reason=reason,
            retry_after_s=wait_ms / 1000,
            charged=charge if reason is None and limits.tpm else 0,
            remaining_requests=None if not limits.rpm else int(r),
            remaining_tokens=None if not limits.tpm else int(t),
            reset_requests_s=None if not limits.rpm else refill_time_s(r, limits.rpm),
            reset_tokens_s=None if not limits.tpm else refill_time_s(t, limits.tpm),
        )

    def hand_over(self, tenant: str, request_id: str) -> None:
        live = self._live.get(tenant)
        if live is None or request_id not in live:
            return
        live[request_id] -= 1
        if live[request_id] <= 0:
            del live[request_id]
        if not live:
            del self._live[tenant]

    async def release(self, tenant: str, limits: Limits, request_id: str, refund: int) -> None:
        self.hand_over(tenant, request_id)
        if limits.max_concurrent is None and (refund <= 0 or not limits.tpm):
            return
        k = self.keys
        await self._eval(
            LIMIT_RELEASE,
            [k.tenant(tenant, "tpm"), k.tenant(tenant, "live")],
            [limits.tpm or 0, max(0, refund), request_id, _WINDOW_MS],
        )

    async def adjust(self, tenant: str, limits: Limits, tokens: int) -> float:
        if not limits.tpm:
            return 0.0
        keys = [self.keys.tenant(tenant, "tpm")]
        return float(await self._eval(LIMIT_ADJUST, keys, [limits.tpm, tokens, _WINDOW_MS]))

    async def usage(self, tenant: str, limits: Limits) -> Decision:
        k = self.keys
        reply = await self._eval(
            LIMIT_USAGE,
            [k.tenant(tenant, "rpm"), k.tenant(tenant, "tpm"), k.tenant(tenant, "live")],
            [limits.rpm or 0, limits.tpm or 0, _WINDOW_MS],
        )
        r, t = float(reply[0]), float(reply[1])
        return Decision(
            allowed=True,
            remaining_requests=None if not limits.rpm else int(r),
            remaining_tokens=None if not limits.tpm else int(t),
            reset_requests_s=None if not limits.rpm else refill_time_s(r, limits.rpm),
            reset_tokens_s=None if not limits.tpm else refill_time_s(t, limits.tpm),
            in_flight=int(reply[2]),
        )

    def _start_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._refresh(), name="wsllm-leases")

    async def _refresh(self) -> None:
        """Keep this gateway's leases alive while their requests run."""
        while self._live:
            await asyncio.sleep(self.lease_ms / 3000)
            for tenant, ids in list(self._live.items()):
                if not ids:
                    continue
                try:
                    keys = [self.keys.tenant(tenant, "live")]
                    await self._eval(LIMIT_REFRESH, keys, [self.lease_ms, *list(ids)])
                except BrokerUnavailable:
                    log.warning("could not refresh the leases of tenant %s: redis is unreachable", tenant)

    async def aclose(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
