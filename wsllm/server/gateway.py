"""The gateway's core, shared by the OpenAI routes and the WebSocket: one request's
start (resolve -> admit -> prepare -> submit), resume and grace aborts. The served
models are `models.py`, preparation (everything that needs the tokenizer)
`prepare.py`, the reader task that fans events out `router.py`, one request's text
work `generation.py`.

Admission comes before preparation: tokenizing a prompt and compiling a grammar are
the gateway's costliest work, and a tenant could multiply them with requests that are
then refused (a 429 must cost the gateway nothing). So rpm, the concurrency lease and
a coarse token charge (the prompt's size estimated from its text) are taken first;
after preparation the charge is set to the exact one and the difference taken or
given back (`quota.py`). A request refused with a 400 by preparation gets its tokens
back and keeps its rpm spent.

Ownership: every request gets an unguessable resume token when it starts, told only to
its client; resuming, reading or cancelling it from another connection, on any gateway,
needs that token (the broker stores only its hash). Ids that clients pick (WebSocket
`id`) never leave their connection.

With a resumable broker (Redis) a request outlives its connection: a client that leaves
detaches (`Generation.leave`), the request runs on for `resume_grace_s`, and
`Gateway.resume` rebuilds its Generation on any gateway by replaying its events from the
first; the same events give the same deltas, so a client that says how many it has gets
exactly the rest."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from wsllm.broker.base import Broker, BrokerError, BrokerUnavailable
from wsllm.broker.limits import Limiter
from wsllm.broker.response_store import ResponseStore
from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import from_broker
from wsllm.server.generation import Generation, Services
from wsllm.server.metrics import Metrics
from wsllm.server.models import ServedModel, ServedModels
from wsllm.server.prepare import Prepared, prepare
from wsllm.server.quota import (
    Coarse,
    admit,
    check_priority,
    coarse_charge,
    compile_charge,
    counted,
    exact_charge,
    kept_charge,
    meter_call,
    take_lease,
)
from wsllm.server.resume import Api, ResumeContext, new_token, split_token
from wsllm.server.router import Router
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.tenants import ANONYMOUS, Tenant
from wsllm.server.text import TextCodec
from wsllm.types import GenerateRequest

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    cfg: GatewayConfig
    broker: Broker
    #: the default model's tokenizer
    codec: TextCodec
    #: the default model: requests that name none go to it
    model_name: str
    metrics: Metrics
    #: tokenizer directories of models served from this process (`serve --model A --model B`)
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)
    router: Router = field(init=False)
    models: ServedModels = field(init=False)
    #: per-tenant limits, shared by every gateway when the broker is (Redis)
    limiter: Limiter = field(init=False)
    #: stored Responses answers, shared by every gateway when the broker is (Redis)
    responses: ResponseStore = field(init=False)
    _later: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    #: background /v1/responses answers running here, by response id (responses_api.py)
    background: dict[str, tuple[Generation, asyncio.Task[None]]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.router = Router(self.broker, self.cfg.max_buffered_events, self.cfg.orphan_timeout_s)
        default = ServedModel(self.model_name, self.codec, self._services(self.codec, self.metrics))
        self.models = ServedModels(self.broker, default, self._services, self.tokenizer_dirs)
        self.limiter = self.broker.limiter()
        self.responses = self.broker.response_store()

    def _services(self, codec: TextCodec, metrics: Metrics) -> Services:
        return Services(codec, metrics, self.broker, self.router, self.abort_later)

    @property
    def svc(self) -> Services:
        """The default model's services."""
        return self.models.default.svc

    async def start(
        self, req: ChatRequest | CompletionRequest, api: Api, tenant: Tenant = ANONYMOUS
    ) -> Generation:
        """Resolve, admit, prepare and submit a checked request of `tenant` (whom its API key
        names). Raises APIError (429 past the tenant's limits, before any tokenizing)."""
        model, max_len = await self.models.resolve(req.model, tenant)
        check_priority(req.priority, tenant, self.cfg.max_priority)
        charge = coarse_charge(req, self.cfg.default_max_tokens)
        return await self._run(
            model, api, tenant, req.priority, charge, lambda: prepare(req, api, model, max_len, self.cfg)
        )

    async def start_prepared(
        self, model: ServedModel, prep: Prepared, api: Api, tenant: Tenant, priority: int = 0
    ) -> Generation:
        """Admit and submit a request its route prepared for `model` (/v1/embeddings
        tokenizes its inputs itself, so its exact charge is known at admission)."""
        exact = exact_charge(len(prep.prompt_ids), prep.params)
        return await self._run(
            model, api, tenant, priority, Coarse(exact, exact), lambda: asyncio.sleep(0, prep)
        )

    async def _run(
        self, model: ServedModel, api: Api, tenant: Tenant, priority: int, charge: Coarse,
        prepared: Callable[[], Awaitable[Prepared]],
    ) -> Generation:  # fmt: skip
        """Admit with `charge`, then prepare (not on a refusal), refine the charge, submit."""
        rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
        metrics = model.svc.metrics
        with counted(metrics, tenant):  # a 429 here or after tokenizing (larger than its tpm)
            ticket = await admit(self.limiter, tenant, rid, charge.estimate, charge.least)
            try:
                prep = await prepared()
                spec = compile_charge(prep.compile_s, self.cfg.spec_compile_tokens_per_s)
                await ticket.refine(exact_charge(len(prep.prompt_ids), prep.params, spec))
                ticket.kept = kept_charge(len(prep.prompt_ids), prep.params, spec)
                gen = await self._submit(model, prep, rid, priority, tenant.name)
            except BaseException:
                await ticket.release(0)  # never queued: nothing used
                raise

        async def release(used: int | None) -> None:
            metrics.tenant_completion(tenant.name, gen.usage.completion_tokens)
            await ticket.release(used)

        gen.on_release = release
        gen.on_hand_over = ticket.hand_over
        gen.ratelimit_headers = ticket.headers
        metrics.prompt_tokens.inc(len(prep.prompt_ids))
        metrics.tenant_admitted(tenant.name, len(prep.prompt_ids))
        return gen

    async def meter(self, tenant: Tenant, metrics: Metrics | None = None) -> dict[str, str]:
        """One request of `tenant`'s rpm for a call that generates nothing (`/tokenize`,
        `/detokenize`, a resume), taken before its work; its x-ratelimit-* headers. A
        refusal (429 APIError) counts in `metrics` (the default model's when None)."""
        with counted(metrics or self.metrics, tenant):
            return await meter_call(self.limiter, tenant)

    async def charge_work(self, tenant: Tenant, tokens: int) -> None:
        """Take `tokens` from `tenant`'s tokens bucket for work already done that
        generates nothing (`/tokenize`'s and `/detokenize`'s token counts): never refused
        (the rpm was taken before the work, by `meter`), but the tenant's next requests
        wait for the bucket to fill again. Nothing without a tpm."""
        if tokens > 0 and tenant.limits.tpm:
            try:
                await self.limiter.adjust(tenant.name, tenant.limits, tokens)
            except BrokerError:  # the answer is computed: a broker fault does not withhold it
                log.warning("could not charge %d tokens to tenant %s", tokens, tenant.name)

    async def _submit(
        self, model: ServedModel, prep: Prepared, rid: str, priority: int, tenant: str
    ) -> Generation:
        gen = Generation(model.svc, rid, prep.prompt_ids, prep.params, prep.context)
        gen.resume_token, prep.context.token_sha256 = new_token(rid)
        now = time.time()
        deadline = now + self.cfg.queue_timeout_s if self.cfg.queue_timeout_s else 0.0
        request = GenerateRequest(
            rid, prep.prompt_ids, prep.params, model=model.name, arrival_time=now,
            queue_deadline=deadline, priority=priority, tenant=tenant,
        )  # fmt: skip
        try:
            await self.broker.submit(
                request, context=prep.context.encode() if self.broker.resumable else None
            )
        except BrokerError as e:
            self.router.close(rid)
            raise from_broker(e) from None
        return gen

    async def resume(
        self, token: str, request_id: str | None = None, tenant: Tenant = ANONYMOUS
    ) -> Generation | None:
        """The Generation of the request that `token` (its resume token) names, started on
        any gateway, replaying its events from the first; None when the broker does not know
        it, cannot resume, or the token does not match (a wrong token tells nothing).
        `request_id`, when given, must be the token's. Takes one rpm of `tenant` first (429
        past it) and the request's concurrency lease again, held until it ends or leaves."""
        headers = await self.meter(tenant)
        rid, secret = split_token(token)
        if not self.broker.resumable or not rid or (request_id is not None and request_id != rid):
            return None
        try:
            found = await self.broker.lookup(rid)
            if found is None:
                return None
            ctx = ResumeContext.decode(found.context)
            if not ctx.matches(secret):
                return None
            model = await self.models.served(ctx.model or self.model_name)
            ticket = await take_lease(self.limiter, tenant, found.request_id)
            gen = None
            try:
                gen = Generation.from_context(model.svc, found.request_id, ctx)
                gen.attach = await self.broker.follow(found.request_id)
            except BaseException:
                if gen is not None:
                    self.router.close(found.request_id)  # nobody reads the new inbox
                await ticket.release(None)
                raise
        except BrokerUnavailable as e:
            raise from_broker(e) from None
        except (TypeError, ValueError):  # a context this gateway cannot read
            log.exception("request %s: unreadable resume context", rid)
            return None
        gen.on_release, gen.on_hand_over = ticket.release, ticket.hand_over
        gen.ratelimit_headers = headers | ticket.headers
        return gen

    def abort_later(
        self, request_id: str, attach: int, after: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        """Abort a detached request after the grace time, unless its owner resumed it
        since it attached for the `attach`-th time; then `after(aborted)`. A request
        that ended and expired meanwhile counts as not aborted: its lease then expires
        by itself (--limit-lease-s)."""

        async def later() -> None:
            await asyncio.sleep(self.broker.resume_grace_s)
            aborted = False
            try:
                aborted = await self.broker.abort_unless_resumed(request_id, attach)
                if aborted:
                    self.metrics.aborts.inc()
            except BrokerUnavailable:
                log.warning("could not abort detached request %s: the broker is unreachable", request_id)
            finally:
                if after is not None:
                    await after(aborted)

        task = asyncio.get_running_loop().create_task(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def aclose(self) -> None:
        """Cancel pending grace-time aborts (the app is stopping)."""
        for t in [*self._later, *(task for _, task in self.background.values())]:
            t.cancel()
        await self.limiter.aclose()
        self.models.close()
