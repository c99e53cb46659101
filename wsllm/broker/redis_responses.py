"""The Responses store of `response_store.py` in Redis, shared by every gateway of a
deployment: one hash per response (`{p}:resp:{id}`: `tenant`, `record`) with the
record's TTL. Ownership is checked in the reads, and a delete is one script (check
and delete together), so no key can drop another tenant's response."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wsllm.broker.base import BrokerUnavailable
from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_scripts import RESPONSE_DELETE
from wsllm.broker.response_store import ResponseStore


class RedisResponseStore(ResponseStore):
    def __init__(self, client: Callable[[], Any], keys: Keys) -> None:
        self._client = client  # the gateway side's redis.asyncio client (one per loop)
        self.keys = keys

    async def put(self, response_id: str, tenant: str, record: bytes, ttl_s: float) -> None:
        key = self.keys.response(response_id)
        try:
            async with self._client().pipeline(transaction=True) as p:
                p.hset(key, mapping={"tenant": tenant, "record": record})
                p.pexpire(key, max(1, int(ttl_s * 1000)))
                await p.execute()
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None

    async def get(self, response_id: str, tenant: str) -> bytes | None:
        try:
            owner, record = await self._client().hmget(self.keys.response(response_id), ["tenant", "record"])
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        if owner is None or owner.decode() != tenant:
            return None
        return bytes(record)

    async def delete(self, response_id: str, tenant: str) -> bool:
        try:
            n = await eval_script(
                self._client(), RESPONSE_DELETE, [self.keys.response(response_id)], [tenant]
            )
        except UNAVAILABLE as e:
            raise BrokerUnavailable(f"redis is unreachable: {e}") from None
        return bool(n)
