"""The gateway's core, shared by every API and the WebSocket: a call's admission
(`admitted`: resolve its model, then take its tenant's rpm, concurrency and coarse token
charge, before any work for it; the admitted call then prepares and submits its requests
itself, `Admission.start`), resume and grace aborts. The served models are `models.py`, admission's
tickets `admission.py` and `quota.py`, preparation (everything that needs the
tokenizer) `prepare.py`, the reader task that fans events out `router.py`, one
request's text work `generation.py`.

Admission comes before preparation: tokenizing a prompt, rendering a template,
compiling a grammar and loading a conversation are the gateway's costliest work, and a
tenant could multiply them with requests that are then refused (a 429 must cost the
gateway nothing). After preparation the charge is set to the exact one and the
difference taken or given back. A request refused with a 400 by preparation gets its
tokens back and keeps its rpm spent.

Ownership: every request gets an unguessable resume token when it starts, told only to
its client; resuming, reading or cancelling it from another connection, on any gateway,
needs that token (the broker stores only its hash). Ids that clients pick (WebSocket
`id`) never leave their connection.

With a resumable broker (Redis) a request outlives its connection: a client that leaves
detaches (`Generation.leave`), the request runs on for `resume_grace_s`, and `resume`
rebuilds its Generation on any gateway by replaying its events from the first; the same
events give the same deltas, so a client that says how many it has gets exactly the rest."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsllm.broker.base import BrokerUnavailable, GatewayBroker
from wsllm.broker.limits import Decision, Limiter
from wsllm.config_gateway import GatewayConfig
from wsllm.server.admission import Admission
from wsllm.server.errors import from_broker
from wsllm.server.generation import Generation, Services
from wsllm.server.metrics import Metrics
from wsllm.server.models import ServedModel, ServedModels
from wsllm.server.quota import (
    Charge,
    Ticket,
    admit,
    check_priority,
    counted,
    meter_call,
    take_lease,
    take_request,
)
from wsllm.server.resume import Api, ResumeContext, split_token
from wsllm.server.router import Router
from wsllm.server.tenants import ANONYMOUS, Tenant
from wsllm.server.text import TextCodec

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    cfg: GatewayConfig
    broker: GatewayBroker
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
    _tasks: set[asyncio.Task[Any]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.router = Router(self.broker, self.cfg.max_buffered_events, self.cfg.orphan_timeout_s)
        default = ServedModel(self.model_name, self.codec, self._services(self.codec, self.metrics))
        self.models = ServedModels(self.broker, default, self._services, self.tokenizer_dirs)
        self.limiter = self.broker.limiter()

    def _services(self, codec: TextCodec, metrics: Metrics) -> Services:
        return Services(codec, metrics, self.broker, self.router, self.abort_later)

    @contextlib.asynccontextmanager
    async def admitted(
        self, tenant: Tenant, api: Api, charge: Charge, paid: Decision | None = None
    ) -> AsyncIterator[Admission]:
        """Admit a call of `tenant` (whom its API key names) through `api`: resolve its
        model (404, 503), check its priority (400), then take each coarse charge of
        `charge` (429 past the tenant's limits), all before any work for it (`paid`: its
        first request of rpm, taken before its body was read). What the call neither
        submits nor settles is given back when it leaves this block."""
        model, max_len = await self.models.resolve(charge.model, tenant)
        check_priority(charge.priority, tenant, self.cfg.max_priority)
        tickets: list[Ticket] = []
        adm = Admission(model, max_len, tenant, api, charge.priority, tickets, self.cfg)
        try:
            with counted(model.svc.metrics, tenant):
                for i, c in enumerate(charge.coarse):
                    rid = f"{api.id_prefix}-{uuid.uuid4().hex}"
                    first = paid if i == 0 else None
                    tickets.append(await admit(self.limiter, tenant, rid, c.estimate, c.least, first))
            yield adm
        finally:
            await adm.release_rest()

    async def pay_request(self, tenant: Tenant) -> Decision | None:
        """A call's first request of `tenant`'s rpm, before its body is read (429 past it)."""
        with counted(self.metrics, tenant):
            return await take_request(self.limiter, tenant)

    async def meter(self, tenant: Tenant, metrics: Metrics | None = None) -> dict[str, str]:
        """One request of `tenant`'s rpm for a resume, taken before its replay; its
        x-ratelimit-* headers. A refusal (429 APIError) counts in `metrics`."""
        with counted(metrics or self.metrics, tenant):
            return await meter_call(self.limiter, tenant)

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
            if not ctx.matches(secret, tenant.name):  # a wrong token, or another tenant's
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

        self.spawn(later())

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` in the background (a grace abort, a background response); it is
        cancelled when the app stops."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        """Cancel the background work (the app is stopping)."""
        for t in list(self._tasks):
            t.cancel()
        await self.limiter.aclose()
        self.models.close()
