"""Who is admitted next among the waiting: by priority (higher first; a preempted sequence
before new ones of its priority), then fairly between tenants by tokens served.

Each tenant has a virtual token counter (VTC, "Fairness in Serving Large Language Models",
OSDI '24) that grows by every token the engine computes for it (a prompt-logprobs row at its
budget cost), and the tenant with the lowest counter goes next; ties go to the oldest. A tenant
that comes back after being idle starts just below the lowest counter of the tenants present:
it goes next, but idling banks no credit. With one tenant and one priority this is plain FCFS.
Plain Python over the scheduler's queues, which it reads and never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from wsllm.engine.sequence import Sequence

# Counters kept for tenants with nothing queued, at most (past it the idle ones go).
_MAX_TENANTS = 4096


class Fairness:
    def __init__(self) -> None:
        #: tenant -> tokens computed for it (its virtual counter)
        self.served: dict[str, float] = {}

    def joined(self, seq: Sequence, active: set[str]) -> None:
        """`seq` joins the queues, where the tenants of `active` have sequences."""
        if seq.tenant not in active:  # (back) from idle: no credit for the time away
            self.served[seq.tenant] = self._lifted(seq.tenant, active)
            if len(self.served) > _MAX_TENANTS:  # forget the idle ones
                self.served = {t: c for t, c in self.served.items() if t in active or t == seq.tenant}

    def _lifted(self, tenant: str, active: set[str]) -> float:
        """The counter of `tenant` if it became active now."""
        own = self.served.get(tenant, 0.0)
        if tenant in active or not active:
            return own
        return max(own, min(self.served.get(t, 0.0) for t in active) - 0.5)

    def rank(self, active: set[str]) -> Callable[[int, str], tuple[int, float]]:
        """How a request not yet added would be ranked now (lower goes first): by
        priority, then by its tenant's counter, lifted as `joined` would lift it."""
        lifted: dict[str, float] = {}

        def rank(priority: int, tenant: str) -> tuple[int, float]:
            if tenant not in lifted:
                lifted[tenant] = self._lifted(tenant, active)
            return -priority, lifted[tenant]

        return rank

    def charge(self, seq: Sequence, cost: float) -> None:
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + cost

    def next(self, waiting: Iterable[Sequence]) -> Sequence:
        """The waiting sequence to admit next."""
        served = self.served
        return min(
            enumerate(waiting),
            key=lambda iq: (
                -iq[1].priority,
                iq[1].num_preemptions == 0,
                served.get(iq[1].tenant, 0.0),
                iq[0],
            ),
        )[1]
