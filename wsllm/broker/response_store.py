"""Stored answers of the Responses API (`store: true`), kept by the broker so that
every gateway of a deployment reads the same ones: `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}`.

A record belongs to the tenant whose key made it: `get` and `delete` with another
tenant answer exactly as for an id that does not exist, so a key learns nothing of
another's responses. Every record expires after the TTL it was put with.

The broker a gateway runs on hands it the matching store (`Broker.response_store()`):
this in-process one, bounded by its total size (the oldest records go first), or the
Redis one (`redis_responses.py`), bounded by Redis's own memory policy and the TTL."""

from __future__ import annotations

import abc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: the in-process store's default budget: bytes of records kept at once
DEFAULT_MAX_BYTES = 64 << 20


class ResponseStore(abc.ABC):
    """Records (opaque bytes) by response id, owned by a tenant; call from the loop."""

    @abc.abstractmethod
    async def put(self, response_id: str, tenant: str, record: bytes, ttl_s: float) -> None:
        """Keep `record` for `ttl_s` seconds, readable by `tenant` only."""

    @abc.abstractmethod
    async def get(self, response_id: str, tenant: str) -> bytes | None:
        """The record; None when unknown, expired, or another tenant's."""

    @abc.abstractmethod
    async def delete(self, response_id: str, tenant: str) -> bool:
        """Drop the record; False when there was none that `tenant` owns."""


@dataclass(slots=True)
class _Entry:
    tenant: str
    record: bytes
    expires: float  # time.monotonic()


class MemoryResponseStore(ResponseStore):
    """One process's store: a dict in insertion order, swept from the oldest end."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, response_id: str, tenant: str, record: bytes, ttl_s: float) -> None:
        if len(record) > self.max_bytes:
            log.warning(
                "response %s (%d bytes) is larger than the whole store; not kept", response_id, len(record)
            )
            return
        self._drop(response_id)
        self._entries[response_id] = _Entry(tenant, record, time.monotonic() + ttl_s)
        self._bytes += len(record)
        self._sweep()

    async def get(self, response_id: str, tenant: str) -> bytes | None:
        e = self._entries.get(response_id)
        if e is None or e.tenant != tenant:
            return None
        if e.expires <= time.monotonic():
            self._drop(response_id)
            return None
        return e.record

    async def delete(self, response_id: str, tenant: str) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        e = self._entries.pop(response_id, None)
        if e is not None:
            self._bytes -= len(e.record)

    def _sweep(self) -> None:
        """Expired records from the oldest end, then the oldest while over budget
        (records usually share one TTL, so the oldest expire first)."""
        now = time.monotonic()
        while self._entries:
            rid, e = next(iter(self._entries.items()))
            if e.expires > now and self._bytes <= self.max_bytes:
                return
            self._drop(rid)
