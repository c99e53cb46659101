"""Stored answers of the Responses API (`store: true`), kept by the broker so that
every gateway of a deployment reads the same ones: `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}`.

A record belongs to the tenant whose key made it: `get` and `delete` with another
tenant answer exactly as for an id that does not exist, so a key learns nothing of
another's responses. Every record expires after the TTL it was put with.

Each tenant has a budget of its own (`Budget`: bytes and records, GatewayConfig's
`response_tenant_max_bytes` and `_max_records`): a tenant past it loses its own oldest
records, never another tenant's. `delete` leaves a tombstone for as long as a record
lives: a background response still running when its client deleted it cannot store
itself again (it is stopped too, by the wing).

The broker a gateway runs on hands it the matching store (`Broker.response_store()`):
this in-process one, also bounded by its total size (past it, the oldest records of the
tenant that holds the most go first: a tenant within its budget never pays for others), or
the Redis one (`redis_responses.py`), whose total Redis's `maxmemory` bounds
(docker-compose.yml, docs/deployment.md)."""

from __future__ import annotations

import abc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: the in-process store's default budget: bytes of records kept at once
DEFAULT_MAX_BYTES = 64 << 20
_TOMB_BYTES = 64  # what a tombstone counts for in the store's total


@dataclass(frozen=True, slots=True)
class Budget:
    """What one tenant may keep in a store at once."""

    max_bytes: int
    max_records: int

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_records < 1:
            raise ValueError(f"a response budget needs bytes and records >= 1, got {self}")


#: no budget of its own: only the store's bounds
UNBOUNDED = Budget(1 << 62, 1 << 62)


class ResponseStore(abc.ABC):
    """Records (opaque bytes) by response id, owned by a tenant; call from the loop."""

    @abc.abstractmethod
    async def put(
        self, response_id: str, tenant: str, record: bytes, ttl_s: float, budget: Budget = UNBOUNDED
    ) -> bool:
        """Keep `record` for `ttl_s` seconds, readable by `tenant` only, within the
        tenant's `budget` (its own oldest records go first). False when not kept: it
        was deleted (a tombstone), or it is larger than the whole budget."""

    @abc.abstractmethod
    async def get(self, response_id: str, tenant: str) -> bytes | None:
        """The record; None when unknown, expired, deleted, or another tenant's."""

    @abc.abstractmethod
    async def delete(self, response_id: str, tenant: str, tombstone_s: float = 3600.0) -> bool:
        """Drop the record, leaving a tombstone for `tombstone_s` that no `put` passes;
        False when there was none that `tenant` owns."""


@dataclass(slots=True)
class _Entry:
    tenant: str
    record: bytes  # b"" for a tombstone
    expires: float  # time.monotonic()
    tomb: bool = False

    @property
    def cost(self) -> int:
        """Its share of the store's bytes (a tombstone's: a nominal few)."""
        return _TOMB_BYTES if self.tomb else len(self.record)


class MemoryResponseStore(ResponseStore):
    """One process's store: a dict in insertion order, swept from the oldest end, and
    each tenant's records in their order, for its budget."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._tenants: dict[str, OrderedDict[str, int]] = {}  # tenant -> its records' ids -> bytes
        self._held: dict[str, int] = {}  # tenant -> the sum of its records' bytes

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._tenants.values())

    def tenant_bytes(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    async def put(
        self, response_id: str, tenant: str, record: bytes, ttl_s: float, budget: Budget = UNBOUNDED
    ) -> bool:
        old = self._entries.get(response_id)
        if old is not None and old.tomb and old.expires > time.monotonic():
            return False
        if len(record) > min(self.max_bytes, budget.max_bytes):
            log.warning(
                "response %s (%d bytes) is larger than its budget; not kept", response_id, len(record)
            )
            return False
        self._drop(response_id)
        self._entries[response_id] = e = _Entry(tenant, record, time.monotonic() + ttl_s)
        self._bytes += e.cost
        mine = self._tenants.setdefault(tenant, OrderedDict())
        mine[response_id] = len(record)
        self._held[tenant] = self._held.get(tenant, 0) + len(record)
        while len(mine) > budget.max_records or self._held[tenant] > budget.max_bytes:
            self._drop(next(iter(mine)))  # the tenant's oldest, never another's
        self._sweep()
        return True

    async def get(self, response_id: str, tenant: str) -> bytes | None:
        e = self._entries.get(response_id)
        if e is None or e.tenant != tenant or e.tomb:
            return None
        if e.expires <= time.monotonic():
            self._drop(response_id)
            return None
        return e.record

    async def delete(self, response_id: str, tenant: str, tombstone_s: float = 3600.0) -> bool:
        if await self.get(response_id, tenant) is None:
            return False
        self._drop(response_id)
        self._entries[response_id] = e = _Entry(tenant, b"", time.monotonic() + tombstone_s, tomb=True)
        self._bytes += e.cost
        self._sweep()
        return True

    def _drop(self, response_id: str) -> None:
        e = self._entries.pop(response_id, None)
        if e is None:
            return
        self._bytes -= e.cost
        mine = self._tenants.get(e.tenant)
        size = mine.pop(response_id, None) if mine is not None else None
        if size is not None:
            self._held[e.tenant] -= size
            if not mine:
                del self._tenants[e.tenant], self._held[e.tenant]

    def _sweep(self) -> None:
        """Expired records and tombstones from the oldest end (records usually share one
        TTL, so the oldest expire first); then, while over the total, the oldest records
        of the tenant that holds the most bytes (tombstones alone: the oldest entries)."""
        now = time.monotonic()
        while self._entries:
            rid, e = next(iter(self._entries.items()))
            if e.expires > now:
                break
            self._drop(rid)
        while self._bytes > self.max_bytes and self._entries:
            if not self._tenants:
                self._drop(next(iter(self._entries)))
                continue
            largest = max(self._held, key=self._held.__getitem__)
            self._drop(next(iter(self._tenants[largest])))
