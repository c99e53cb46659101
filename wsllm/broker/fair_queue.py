"""Priority and fair share of the waiting requests, in one process (the memory
broker's queue). The Redis broker keeps the same rules in Lua (`redis_queue.py`).

The rules, shared by both brokers:

- one level per `priority`; an engine takes from the highest level that has a
  request it may take, and a level below is looked at only when the ones above have
  none;
- inside a level one FIFO per tenant, served round robin by a virtual time: each
  request taken moves its tenant's time on by one, the tenant with the smallest time
  goes next, and a tenant that starts waiting joins at the level's clock (the time of
  the last tenant served), so it goes next and cannot bank turns while it was away;
- the queue holds at most `max_queue_depth` requests, and one tenant at most
  `tenant_cap(max_queue_depth, max_queue_share)` of them: a tenant that floods it is
  refused (`QueueFull`) for its own share only, and the others still get in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from wsllm.types import GenerateRequest

#: an engine's admission order of a request (lower first); base.Rank
Rank = Callable[[GenerateRequest], Any]


# QueueFull's messages: which bound refused, never how deep the queue is (a client
# could read another tenant's load from the depth).
QUEUE_FULL = "the queue of requests waiting for an engine is full"
TENANT_SHARE_FULL = "this tenant's share of the queue is full"


def tenant_cap(max_queue_depth: int, max_queue_share: float) -> int:
    """The most waiting requests one tenant may hold: its share of the depth, at
    least one."""
    if not 0 < max_queue_share <= 1:
        raise ValueError(f"max_queue_share must be in (0, 1], got {max_queue_share}")
    return max(1, math.ceil(max_queue_depth * max_queue_share - 1e-9))


@dataclass(slots=True)
class _Level:
    """The waiting requests of one priority: a FIFO and a virtual time per tenant."""

    clock: float = 0.0
    fifo: dict[str, deque[GenerateRequest]] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)

    def push(self, request: GenerateRequest) -> None:
        if request.tenant not in self.fifo:
            self.fifo[request.tenant] = deque()
            self.time[request.tenant] = self.clock  # joins now: next in turn, no banked turns
        self.fifo[request.tenant].append(request)

    def take(self, accept: Callable[[GenerateRequest], bool], rank: Rank | None) -> GenerateRequest | None:
        """The oldest acceptable request of the tenant whose turn it is: by `rank` of
        its first request when given, then by virtual time (stable: earlier joiners
        first among equals)."""

        def turn(tenant: str) -> tuple[Any, float]:
            return (rank(self.fifo[tenant][0]) if rank is not None else 0), self.time[tenant]

        for tenant in sorted(self.fifo, key=turn):
            q = self.fifo[tenant]
            for r in q:
                if accept(r):
                    q.remove(r)
                    self.clock = self.time[tenant]
                    self.time[tenant] += 1
                    if not q:
                        self._drop(tenant)
                    return r
        return None

    def remove(self, request: GenerateRequest) -> None:
        q = self.fifo[request.tenant]
        q.remove(request)
        if not q:
            self._drop(request.tenant)

    def _drop(self, tenant: str) -> None:
        del self.fifo[tenant], self.time[tenant]


class FairQueue:
    """The waiting requests of a memory broker. Not thread-safe: the broker's lock
    guards it."""

    def __init__(self, max_queue_depth: int = 256, max_queue_share: float = 1.0) -> None:
        self.max_queue_depth = max_queue_depth
        self.tenant_cap = tenant_cap(max_queue_depth, max_queue_share)
        self._levels: dict[int, _Level] = {}
        self._by_id: dict[str, GenerateRequest] = {}
        self._per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __iter__(self) -> Iterator[GenerateRequest]:
        return iter(list(self._by_id.values()))

    def refusal(self, request: GenerateRequest) -> str | None:
        """Why `request` cannot queue now (the QueueFull message), or None."""
        if len(self._by_id) >= self.max_queue_depth:
            return QUEUE_FULL
        if self._per_tenant.get(request.tenant, 0) >= self.tenant_cap:
            return TENANT_SHARE_FULL
        return None

    def push(self, request: GenerateRequest) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        self._levels.setdefault(request.priority, _Level()).push(request)
        self._by_id[request.request_id] = request
        self._per_tenant[request.tenant] = self._per_tenant.get(request.tenant, 0) + 1

    def remove(self, request_id: str) -> GenerateRequest | None:
        request = self._by_id.pop(request_id, None)
        if request is not None:
            self._levels[request.priority].remove(request)
            self._forget(request)
        return request

    def take(
        self, max_n: int, accept: Callable[[GenerateRequest], bool], rank: Rank | None = None
    ) -> list[GenerateRequest]:
        """Up to `max_n` acceptable requests, in turn: highest level first, round robin
        by tenant inside it. An engine's `rank` (its scheduler's view: tokens served per
        tenant, which the queue cannot see) orders the tenants before their turns do."""
        out: list[GenerateRequest] = []
        for priority in sorted(self._levels, reverse=True):
            level = self._levels[priority]
            while len(out) < max_n and (r := level.take(accept, rank)) is not None:
                del self._by_id[r.request_id]
                self._forget(r)
                out.append(r)
            if len(out) >= max_n:
                break
        return out

    def _forget(self, request: GenerateRequest) -> None:
        left = self._per_tenant[request.tenant] - 1
        if left:
            self._per_tenant[request.tenant] = left
        else:
            del self._per_tenant[request.tenant]
        level = self._levels[request.priority]
        if not level.fifo:
            del self._levels[request.priority]
