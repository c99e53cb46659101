"""The gateway's core, shared by the OpenAI routes and the WebSocket: admission
(model, limits, tokenization, the broker's queue), resume and grace aborts. The
reader task that fans events out is `router.py`; one request's text work is
`generation.py`.

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

from wsllm.broker.base import Broker, BrokerClosed, BrokerUnavailable, EngineInfo, QueueFull
from wsllm.broker.limits import Limiter
from wsllm.config import GatewayConfig
from wsllm.server.errors import APIError
from wsllm.server.generation import Generation, Services
from wsllm.server.metrics import Metrics
from wsllm.server.quota import admit
from wsllm.server.router import Router
from wsllm.server.schemas import ChatRequest, CompletionRequest, sampling_params
from wsllm.server.tenants import ANONYMOUS, Tenant
from wsllm.server.text import TemplateError, TextCodec
from wsllm.types import GenerateRequest, SamplingParams

log = logging.getLogger(__name__)

# Prompts longer than this (characters, counting each message's overhead) are
# tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 4096
_MESSAGE_OVERHEAD_CHARS = 16


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
    codec: TextCodec
    model_name: str
    metrics: Metrics
    router: Router = field(init=False)
    svc: Services = field(init=False)
    #: per-tenant limits, shared by every gateway when the broker is (Redis)
    limiter: Limiter = field(init=False)
    _later: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.router = Router(self.broker, self.cfg.max_buffered_events)
        self.svc = Services(self.codec, self.metrics, self.broker, self.router, self.abort_later)
        self.limiter = self.broker.limiter()

    async def engines(self) -> list[EngineInfo]:
        """Live engines serving this model; none while the broker is unreachable."""
        try:
            infos = await self.broker.engines()
        except BrokerUnavailable:
            return []
        return [e for e in infos if e.model == self.model_name or not e.model]

    async def max_model_len(self) -> int | None:
        lens = [e.max_model_len for e in await self.engines() if e.max_model_len]
        return min(lens) if lens else None

    async def refresh_gauges(self) -> None:
        self.metrics.set_engine_stats([e.stats for e in await self.engines()], await self.broker.pending())

    async def start(
        self, req: ChatRequest | CompletionRequest, api: str, tenant: Tenant = ANONYMOUS
    ) -> Generation:
        """Admit, tokenize and submit a checked request of `tenant` (whom its API key
        names). Raises APIError (429 `rate_limited` past the tenant's limits). The
        Generation's `resume_token` is for its client alone."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                "model_not_found",
                f"model {req.model!r} is not served here; try {self.model_name!r}",
                param="model",
            )
        if not tenant.may_use(self.model_name):  # the same answer as a model not served here
            raise APIError(
                404, "model_not_found", f"model {self.model_name!r} is not available to this key", "model"
            )
        engines = await self.engines()
        if not engines:
            raise APIError(503, "model_not_ready", "no engine is serving this model yet", retry_after=1)
        cap = self.cfg.max_priority if tenant.max_priority is None else tenant.max_priority
        if req.priority > cap:
            raise APIError(400, "invalid_request", f"priority must be at most {cap} for this key", "priority")
        prompt_ids = await self._prompt_ids(req)
        max_len = min(e.max_model_len for e in engines)
        params = sampling_params(req, len(prompt_ids), max_len, self.cfg)
        rid = f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        ticket = await admit(self.limiter, tenant, rid, len(prompt_ids) + params.n * params.max_tokens)
        try:
            gen = await self._submit(req, api, rid, prompt_ids, params, tenant.name)
        except BaseException:
            await ticket.release(0)  # never queued: nothing used
            raise
        gen.on_release = ticket.release
        gen.ratelimit_headers = ticket.headers
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def _submit(
        self,
        req: ChatRequest | CompletionRequest,
        api: str,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str,
    ) -> Generation:
        gen = Generation(self.svc, rid, prompt_ids, params, req.stops, api)
        secret = secrets.token_urlsafe(24)
        gen.resume_token = f"{rid}.{secret}"
        gen.context["include_usage"] = bool(getattr(req, "include_usage", False))
        gen.context["token_sha256"] = _digest(secret)
        try:
            await self.broker.submit(
                GenerateRequest(
                    rid,
                    prompt_ids,
                    params,
                    model=self.model_name,
                    arrival_time=(now := time.time()),
                    queue_deadline=now + self.cfg.queue_timeout_s if self.cfg.queue_timeout_s else 0.0,
                    priority=req.priority,
                    tenant=tenant,
                ),
                max_waiting=self.cfg.max_queue_depth,
                context=gen.context if self.broker.resumable else None,
            )
        except QueueFull as e:
            self.router.close(rid)
            raise APIError(429, "queue_full", f"the server is busy: {e}", retry_after=1) from None
        except BrokerClosed:
            self.router.close(rid)
            raise APIError(503, "model_not_ready", "the server is shutting down", retry_after=1) from None
        except BrokerUnavailable:
            self.router.close(rid)
            raise APIError(
                503, "model_not_ready", "the broker is unreachable; retry", retry_after=1
            ) from None
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
            want = found.context.get("token_sha256") if found is not None else None
            if found is None or not isinstance(want, str) or not hmac.compare_digest(want, _digest(secret)):
                return None
            gen = Generation.from_context(self.svc, found.request_id, found.context)
            try:
                gen.attach = await self.broker.follow(found.request_id)
            except BaseException:
                self.router.close(found.request_id)  # nobody reads the new inbox
                raise
        except BrokerUnavailable:
            raise APIError(
                503, "model_not_ready", "the broker is unreachable; retry", retry_after=1
            ) from None
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
        for t in list(self._later):
            t.cancel()
        await self.limiter.aclose()

    def _check_vocab(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t >= self.codec.vocab_size]
        if bad:
            raise APIError(
                400,
                "invalid_request",
                f"{param}: token id {bad[0]} is not in the vocabulary (size {self.codec.vocab_size})",
                param=param,
            )

    async def _prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        self._check_vocab(req.stop_token_ids or [], "stop_token_ids")
        if isinstance(req, CompletionRequest):
            if isinstance(req.prompt, list):
                self._check_vocab(req.prompt, "prompt")
                return list(req.prompt)
            return await self._run_text(self.codec.encode, req.prompt, len(req.prompt))
        messages = [m.as_template_input() for m in req.messages]
        size = sum(len(m["content"]) + _MESSAGE_OVERHEAD_CHARS for m in messages)
        try:
            return await self._run_text(self.codec.encode_chat, messages, size)
        except TemplateError as e:
            raise APIError(400, "invalid_request", f"messages: {e}", param="messages") from None

    @staticmethod
    async def _run_text(fn, arg, size: int):  # type: ignore[no-untyped-def]
        if size <= _TOKENIZE_INLINE_CHARS:
            return fn(arg)
        return await asyncio.to_thread(fn, arg)
