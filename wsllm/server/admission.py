"""A call that its tenant's limits admitted (`Admission`, made by `Gateway.admitted`):
the model it goes to, and one ticket per engine request it may make, each taken from
the tenant's rpm, concurrency and tokens with the call's coarse charge (quota.py)
before any of its work. Only an admitted call prepares (templates, tokenizes, compiles,
loads history); then each of its requests is submitted (`submit`: the charge set to
the exact one, the ticket handed to the request's Generation) or, for a call that
generates nothing, settled at its token count (`settle`). What is neither when the
call ends is given back whole (`release_rest`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from wsllm.server.generation import Generation
from wsllm.server.models import ServedModel
from wsllm.server.prepare import Prepared
from wsllm.server.quota import Ticket, compile_charge, counted, exact_charge, kept_charge
from wsllm.server.resume import Api
from wsllm.server.tenants import Tenant

log = logging.getLogger(__name__)

#: Gateway._submit: (model, prepared, request id, priority, tenant) -> its Generation
Submit = Callable[[ServedModel, Prepared, str, int, Tenant], Awaitable[Generation]]


@dataclass(slots=True)
class Admission:
    #: the model the call names (or the default), and the context its live engines allow
    model: ServedModel
    max_len: int
    tenant: Tenant
    api: Api
    priority: int
    #: one per engine request the call may make, in the order of its charge
    tickets: list[Ticket]
    submit_to: Submit
    #: tokens charged per second of a structured-output spec's compile
    spec_tokens_per_s: int
    _done: set[int] = field(default_factory=set)  # tickets handed on or settled

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* of the last ticket taken: the freshest figures."""
        return self.tickets[-1].headers

    async def submit(self, i: int, prep: Prepared) -> Generation:
        """Submit the call's `i`-th request, prepared: its charge set to the exact one
        (a 429 when that is over the tenant's whole tpm), its ticket handed to its
        Generation, which gives back what it did not use when it ends."""
        ticket, metrics = self.tickets[i], self.model.svc.metrics
        spec = compile_charge(prep.compile_s, self.spec_tokens_per_s)
        with counted(metrics, self.tenant):  # a 429 after tokenizing: larger than its tpm
            await ticket.refine(exact_charge(len(prep.prompt_ids), prep.params, spec))
        ticket.kept = kept_charge(len(prep.prompt_ids), prep.params, spec)
        gen = await self.submit_to(self.model, prep, ticket.request_id, self.priority, self.tenant)
        self._done.add(i)
        tenant = self.tenant.name

        async def release(used: int | None) -> None:
            metrics.tenant_completion(tenant, gen.usage.completion_tokens)
            await ticket.release(used)

        gen.on_release = release
        gen.on_hand_over = ticket.hand_over
        gen.ratelimit_headers = ticket.headers
        metrics.prompt_tokens.inc(len(prep.prompt_ids))
        metrics.tenant_admitted(tenant, len(prep.prompt_ids))
        return gen

    async def settle(self, i: int, tokens: int) -> dict[str, str]:
        """The `i`-th ticket of a call that generates nothing, done: `tokens` (its exact
        charge, the prompt it read) taken, its lease released. Its x-ratelimit-* headers."""
        ticket = self.tickets[i]
        self._done.add(i)
        await ticket.settle(tokens)
        return ticket.headers

    async def release_rest(self) -> None:
        """Give back, whole, every ticket neither submitted nor settled (the call failed
        or ended before them)."""
        for i, ticket in enumerate(self.tickets):
            if i not in self._done:
                self._done.add(i)
                await ticket.release(0)
