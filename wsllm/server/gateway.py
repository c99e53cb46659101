"""The gateway's core, shared by the OpenAI routes and the WebSocket: one request's
start (resolve -> prepare -> admit -> submit), resume and grace aborts. The served
models are `models.py`, preparation (everything that needs the tokenizer) is
`prepare.py`, the reader task that fans events out is `router.py`, and one request's
text work is `generation.py`.

A tenant's admission comes after preparation: its token charge is the prompt's
tokens plus n x max_tokens, which only the tokenizer and the model's context tell,
and a request that is refused with a 400 costs its tenant nothing.

Ownership: every request gets an unguessable resume token when it starts (the
client that started it is the only one told). Resuming, reading or cancelling it
from another connection, on any gateway, needs that token; the broker stores only
its hash. Ids that clients pick (WebSocket `id`) never leave their connection.

With a resumable broker (Redis) a request outlives its connection: a client that
leaves detaches (`Generation.leave`), the request runs on for `resume_grace_s`, and
`Gateway.resume` rebuilds its Generation on any gateway by replaying its events
from the first one. Replaying the same events gives the same deltas, so a client
that says how many it has gets exactly the rest."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from wsllm.broker.base import Broker, BrokerError, BrokerUnavailable
from wsllm.broker.limits import Limiter
from wsllm.broker.response_store import ResponseStore
from wsllm.config import GatewayConfig
from wsllm.server.errors import APIError, from_broker
from wsllm.server.generation import Generation, Services
from wsllm.server.metrics import Metrics
from wsllm.server.models import ServedModel, ServedModels
from wsllm.server.prepare import Prepared, prepare
from wsllm.server.quota import Ticket, admit
from wsllm.server.resume import Api, ResumeContext
from wsllm.server.router import Router
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.tenants import ANONYMOUS, Tenant
from wsllm.server.text import TextCodec
from wsllm.types import GenerateRequest

log = logging.getLogger(__name__)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_token(token: str) -> tuple[str, str]:
    """(request id, secret) of a resume token; ("", "") when it is not one."""
    rid, dot, secret = token.rpartition(".")
    return (rid, secret) if dot and rid and secret else ("", "")


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
        """Resolve, prepare, admit and submit a checked request of `tenant` (whom its
        API key names). Raises APIError (429 `rate_limited` past the tenant's limits).
        The Generation's `resume_token` is for its client alone."""
        model, max_len = await self.models.resolve(req.model, tenant)
        self._check_priority(req.priority, tenant)
        prep = await prepare(req, api, model, max_len, self.cfg)
        return await self.start_prepared(model, prep, api, tenant, req.priority)

    async def start_prepared(
        self, model: ServedModel, prep: Prepared, api: Api, tenant: Tenant, priority: int = 0
    ) -> Generation:
        """Admit and submit a request prepared for `model` (resolved for `tenant`, its
        priority checked): `start`'s last stages, which /v1/embeddings shares."""
        rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
        ticket = await self._admit(model, tenant, rid, prep)
        try:
            gen = await self._submit(model, prep, rid, priority, tenant.name)
        except BaseException:
            await ticket.release(0)  # never queued: nothing used
            raise
        metrics = model.svc.metrics

        async def release(used: int | None) -> None:
            metrics.tenant_completion(tenant.name, gen.usage.completion_tokens)
            await ticket.release(used)

        gen.on_release = release
        gen.ratelimit_headers = ticket.headers
        metrics.prompt_tokens.inc(len(prep.prompt_ids))
        metrics.tenant_admitted(tenant.name, len(prep.prompt_ids))
        return gen

    def _check_priority(self, priority: int, tenant: Tenant) -> None:
        cap = self.cfg.max_priority if tenant.max_priority is None else tenant.max_priority
        if priority > cap:
            raise APIError(400, "invalid_request", f"priority must be at most {cap} for this key", "priority")

    async def _admit(self, model: ServedModel, tenant: Tenant, rid: str, prep: Prepared) -> Ticket:
        """Take the request's share of the tenant's limits: one request, and its prompt
        plus the most it may generate in tokens."""
        charge = len(prep.prompt_ids) + prep.params.n * prep.params.max_tokens
        try:
            return await admit(self.limiter, tenant, rid, charge)
        except APIError as e:
            if e.code == "rate_limited":
                model.svc.metrics.tenant_limited(tenant.name)
            raise

    async def _submit(
        self, model: ServedModel, prep: Prepared, rid: str, priority: int, tenant: str
    ) -> Generation:
        gen = Generation(model.svc, rid, prep.prompt_ids, prep.params, prep.context)
        secret = secrets.token_urlsafe(24)
        gen.resume_token = f"{rid}.{secret}"
        prep.context.token_sha256 = _digest(secret)
        now = time.time()
        request = GenerateRequest(
            rid,
            prep.prompt_ids,
            prep.params,
            model=model.name,
            arrival_time=now,
            queue_deadline=now + self.cfg.queue_timeout_s if self.cfg.queue_timeout_s else 0.0,
            priority=priority,
            tenant=tenant,
        )
        try:
            await self.broker.submit(
                request, context=prep.context.encode() if self.broker.resumable else None
            )
        except BrokerError as e:
            self.router.close(rid)
            raise from_broker(e) from None
        return gen

    async def resume(self, token: str, request_id: str | None = None) -> Generation | None:
        """The Generation of the request that `token` (its resume token) names, started
        on any gateway, replaying its events from the first; None when the broker does
        not know it, cannot resume at all, or the token does not match (the same
        answer: a wrong token tells nothing). `request_id`, when given, must be the
        token's request."""
        rid, secret = split_token(token)
        if not self.broker.resumable or not rid or (request_id is not None and request_id != rid):
            return None
        try:
            found = await self.broker.lookup(rid)
            if found is None:
                return None
            ctx = ResumeContext.decode(found.context)
            if not ctx.token_sha256 or not hmac.compare_digest(ctx.token_sha256, _digest(secret)):
                return None
            model = await self.models.served(ctx.model or self.model_name)
            gen = Generation.from_context(model.svc, found.request_id, ctx)
            try:
                gen.attach = await self.broker.follow(found.request_id)
            except BaseException:
                self.router.close(found.request_id)  # nobody reads the new inbox
                raise
        except BrokerUnavailable as e:
            raise from_broker(e) from None
        except (TypeError, ValueError):  # a context this gateway cannot read
            log.exception("request %s: unreadable resume context", rid)
            return None
        return gen

    def abort_later(self, request_id: str, attach: int) -> None:
        """Abort a detached request after the grace time, unless its owner resumed it
        since it attached for the `attach`-th time."""

        async def later() -> None:
            await asyncio.sleep(self.broker.resume_grace_s)
            try:
                if await self.broker.abort_unless_resumed(request_id, attach):
                    self.metrics.aborts.inc()
            except BrokerUnavailable:
                log.warning("could not abort detached request %s: the broker is unreachable", request_id)

        task = asyncio.get_running_loop().create_task(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def aclose(self) -> None:
        """Cancel pending grace-time aborts (the app is stopping)."""
        for t in [*self._later, *(task for _, task in self.background.values())]:
            t.cancel()
        await self.limiter.aclose()
        self.models.close()
