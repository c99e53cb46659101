"""The Responses store of `response_store.py` in Redis, shared by every gateway of a
deployment. A tenant's keys share the slot of `{r:tenant}`:

    {p}:{r:tenant}:resp:{id}   one response (hash: `record`, or `tomb` once deleted), with
                               the record's TTL
    {p}:{r:tenant}:resps       the tenant's records (sorted set: id -> expiry), oldest first
    {p}:{r:tenant}:rsizes      their sizes (hash: id -> bytes), for its budget

A record's key is named by its tenant, so another tenant's key reads and deletes
another (empty) hash: ownership needs no check. A put and a delete are one script
each (`lua/response_put.lua`: the tenant's budget, its oldest first; `response_delete.lua`:
the tombstone)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wsllm.broker.base import BrokerUnavailable
from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_scripts import RESPONSE_DELETE, RESPONSE_PUT
from wsllm.broker.response_store import UNBOUNDED, Budget, ResponseStore


class RedisResponseStore(ResponseStore):
    def __init__(self, client: Callable[[], Any], keys: Keys) -> None:
        self._client = client  # the gateway side's redis.asyncio client (one per loop)
        self.keys = keys

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        k = self.keys
        return [k.response(tenant, response_id), k.responses(tenant, "resps"), k.responses(tenant, "rsizes")]

    async def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await eval_script(self._client(), script, keys, args)
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None

    async def put(
        self, response_id: str, tenant: str, record: bytes, ttl_s: float, budget: Budget = UNBOUNDED
    ) -> bool:
        if len(record) > budget.max_bytes:
            return False
        ttl_ms = max(1, int(ttl_s * 1000))
        args = [
            response_id,
            record,
            ttl_ms,
            budget.max_bytes,
            budget.max_records,
            self.keys.response(tenant, ""),
        ]
        return bool(await self._eval(RESPONSE_PUT, self._keys(tenant, response_id), args))

    async def get(self, response_id: str, tenant: str) -> bytes | None:
        try:
            record = await self._client().hget(self.keys.response(tenant, response_id), "record")
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        return None if record is None else bytes(record)

    async def delete(self, response_id: str, tenant: str, tombstone_s: float = 3600.0) -> bool:
        args = [response_id, max(1, int(tombstone_s * 1000))]
        return bool(await self._eval(RESPONSE_DELETE, self._keys(tenant, response_id), args))
