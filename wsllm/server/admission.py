"""A call that its tenant's limits admitted (`Admission`, made by `Gateway.admitted`):
the model it goes to, and one ticket per engine request it may make, each taken from
the tenant's rpm, concurrency and tokens with the call's coarse charge (quota.py)
before any of its work. Only an admitted call prepares (templates, tokenizes, compiles,
loads history); then each of its requests is submitted (`start`: prepared and submitted;
`submit`: one prepared already; the charge set to the exact one, the request sent to the
broker, the ticket handed to its Generation) or, for a call that generates nothing, settled
at its token count (`settle`). What is neither when the call ends is given back whole
(`release_rest`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from wsllm.broker.base import BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import from_broker
from wsllm.server.generation import Generation
from wsllm.server.models import ServedModel
from wsllm.server.prepare import Prepared, prepare
from wsllm.server.quota import Ticket, compile_charge, counted, exact_charge, kept_charge
from wsllm.server.resume import Api, new_token
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.tenants import Tenant
from wsllm.types import GenerateRequest, PromptImage

log = logging.getLogger(__name__)


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
    cfg: GatewayConfig
    _done: set[int] = field(default_factory=set)  # tickets handed on or settled

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* of the last ticket taken: the freshest figures."""
        return self.tickets[-1].headers

    async def start(self, i: int, request: ChatRequest | CompletionRequest) -> Generation:
        """Prepare and submit the call's `i`-th request, a chat or completion of one prompt."""
        return await self.submit(i, await self.prepare(request))

    async def prepare(self, request: ChatRequest | CompletionRequest) -> Prepared:
        """A request of the call prepared for its model (prepare.py: the 400s that need the
        tokenizer); `submit` sends it."""
        return await prepare(request, self.api, self.model, self.max_len, self.cfg, self.tenant.name)

    async def submit(self, i: int, prep: Prepared) -> Generation:
        """Submit the call's `i`-th request, prepared: its charge set to the exact one
        (a 429 when that is over the tenant's whole tpm), its ticket handed to its
        Generation, which gives back what it did not use when it ends."""
        ticket, metrics = self.tickets[i], self.model.svc.metrics
        spec = compile_charge(prep.compile_s, self.cfg.spec_compile_tokens_per_s)
        with counted(metrics, self.tenant):  # a 429 after tokenizing: larger than its tpm
            await ticket.refine(exact_charge(len(prep.prompt_ids), prep.params, spec))
        ticket.kept = kept_charge(len(prep.prompt_ids), prep.params, spec)
        gen = await self._send(prep, ticket.request_id)
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

    async def _send(self, prep: Prepared, rid: str) -> Generation:
        """The request to the broker, with its resume token's hash in its context."""
        svc, tenant = self.model.svc, self.tenant
        gen = Generation(svc, rid, prep.prompt_ids, prep.params, prep.context)
        gen.resume_token, prep.context.token_sha256 = new_token(rid)
        prep.context.tenant = tenant.name  # its resume is this tenant's alone
        now = time.time()
        deadline = now + self.cfg.queue_timeout_s if self.cfg.queue_timeout_s else 0.0
        request = GenerateRequest(
            rid, prep.prompt_ids, prep.params, model=self.model.name, arrival_time=now,
            queue_deadline=deadline, priority=self.priority, tenant=tenant.name, lora=self.model.lora,
            cache_salt=tenant.cache_namespace(prep.cache_salt),  # its KV is its tenant's alone
            images=[PromptImage.of(im.data, im.digest, s.start, s.length) for im, s in prep.images],
        )  # fmt: skip
        try:
            await svc.broker.submit(request, context=prep.context.encode() if svc.broker.resumable else None)
        except BrokerError as e:
            svc.router.close(rid)
            raise from_broker(e) from None
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
