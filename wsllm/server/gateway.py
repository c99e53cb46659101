"""The gateway's core, shared by the OpenAI routes and the WebSocket: admission
(model, limits, tokenization, the broker's queue), resume and grace aborts. The
reader task that fans events out is `router.py`; one request's text work is
`generation.py`.

Models: a gateway serves every model a live engine serves (`broker.engines()`), by
its name or one of its aliases. Each model gets its tokenizer (`ServedModel`) on first
sight: from a directory this process was given, else from the files its engines
published through the broker (Redis), written to a private temporary directory.

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
import functools
import hashlib
import hmac
import logging
import secrets
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsllm.broker.base import (
    TOKENIZER_FILES,
    Broker,
    BrokerClosed,
    BrokerUnavailable,
    EngineInfo,
    QueueFull,
)
from wsllm.broker.limits import Limiter
from wsllm.config import GatewayConfig
from wsllm.server.chat.output import OutputOptions
from wsllm.server.chat.plan import checked, plan_chat, wanted_constraint
from wsllm.server.errors import APIError
from wsllm.server.generation import Generation, Services
from wsllm.server.metrics import Metrics
from wsllm.server.quota import admit
from wsllm.server.router import Router
from wsllm.server.schemas import (
    ChatRequest,
    CompletionRequest,
    Detokenize,
    TokenizeChat,
    TokenizeCompletion,
    sampling_params,
)
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


def _by_alias(live: dict[str, list[EngineInfo]], alias: str) -> str | None:
    return next((m for m, engines in live.items() if any(alias in e.aliases for e in engines)), None)


@dataclass(slots=True)
class ServedModel:
    """A model this gateway routes to: its canonical name, tokenizer and the services
    its Generations use (metrics labelled with its name)."""

    name: str
    codec: TextCodec
    svc: Services


@dataclass
class Gateway:
    cfg: GatewayConfig
    broker: Broker
    codec: TextCodec
    #: the default model: requests that name none go to it
    model_name: str
    metrics: Metrics
    #: tokenizer directories of models served from this process (`serve --model A --model B`)
    tokenizer_dirs: dict[str, Path] = field(default_factory=dict)
    router: Router = field(init=False)
    svc: Services = field(init=False)
    #: per-tenant limits, shared by every gateway when the broker is (Redis)
    limiter: Limiter = field(init=False)
    _models: dict[str, ServedModel] = field(init=False, default_factory=dict)
    _loading: dict[str, asyncio.Future[ServedModel]] = field(init=False, default_factory=dict)
    _tok_root: Path | None = field(init=False, default=None)
    _later: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.router = Router(self.broker, self.cfg.max_buffered_events)
        self.svc = self._services(self.codec, self.metrics)
        self._models[self.model_name] = ServedModel(self.model_name, self.codec, self.svc)
        self.limiter = self.broker.limiter()

    def _services(self, codec: TextCodec, metrics: Metrics) -> Services:
        return Services(codec, metrics, self.broker, self.router, self.abort_later)

    async def engines(self, model: str | None = None) -> list[EngineInfo]:
        """Live engines (of `model` only, when given); none while the broker is
        unreachable."""
        try:
            infos = await self.broker.engines()
        except BrokerUnavailable:
            return []
        return infos if model is None else [e for e in infos if (e.model or self.model_name) == model]

    async def live_models(self) -> dict[str, list[EngineInfo]]:
        """Each model a live engine serves, with its engines, the default model first."""
        out: dict[str, list[EngineInfo]] = {}
        for e in sorted(await self.engines(), key=lambda e: (e.model != self.model_name, e.model)):
            out.setdefault(e.model or self.model_name, []).append(e)
        return out

    async def max_model_len(self, model: str | None = None) -> int | None:
        lens = [e.max_model_len for e in await self.engines(model or self.model_name) if e.max_model_len]
        return min(lens) if lens else None

    async def refresh_gauges(self) -> None:
        live = await self.live_models()
        pending = await self.broker.pending()
        for name in set(live) | set(self._models):
            stats = [e.stats for e in live.get(name, [])]
            self.metrics.for_model(name).set_engine_stats(stats, pending if name == self.model_name else 0)

    async def resolve(self, requested: str | None, tenant: Tenant = ANONYMOUS) -> tuple[ServedModel, int]:
        """The model a request names (its name or an alias; none: the default model)
        and the context length its live engines allow. 404 `model_not_found` for a
        model nobody serves or this tenant may not use, 503 `model_not_ready` for a
        known model whose engines are all gone."""
        live = await self.live_models()
        want = requested or self.model_name
        name = want if want in live else _by_alias(live, want)
        if name is None or not tenant.may_use(name):
            usable = [m for m in live if tenant.may_use(m)]
            known = want in self._models or want in self.tokenizer_dirs
            if name is None and known and tenant.may_use(want):
                raise APIError(503, "model_not_ready", f"no engine is serving {want!r} now", retry_after=1)
            hint = f"; served here: {', '.join(usable)}" if usable else ""
            what = "is not served here" if name is None else "is not available to this key"
            raise APIError(404, "model_not_found", f"model {want!r} {what}{hint}", param="model")
        served = self._models.get(name) or await self._load(name)
        return served, min(e.max_model_len for e in live[name])

    async def served(self, name: str) -> ServedModel:
        """A model's tokenizer and services by its canonical name (loaded on first use)."""
        return self._models.get(name) or await self._load(name)

    async def _load(self, name: str) -> ServedModel:
        """Load `name`'s tokenizer once, however many requests ask at the same time."""
        fut = self._loading.get(name)
        if fut is None:
            fut = self._loading[name] = asyncio.get_running_loop().create_future()
            try:
                directory = self.tokenizer_dirs.get(name) or await self._fetch_tokenizer(name)
                codec = await asyncio.to_thread(TextCodec, str(directory))
                served = ServedModel(name, codec, self._services(codec, self.metrics.for_model(name)))
                self._models[name] = served
                fut.set_result(served)
                log.info("model %s: tokenizer loaded from %s", name, directory)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: callers that are gone do not warn
                raise
            finally:
                del self._loading[name]
            return served
        return await asyncio.shield(fut)

    async def _fetch_tokenizer(self, name: str) -> Path:
        try:
            files = await self.broker.tokenizer_files(name)
        except BrokerUnavailable:
            files = None
        if not files or "tokenizer.json" not in files:
            raise APIError(
                503, "model_not_ready", f"no tokenizer for {name!r} has been published yet", retry_after=1
            )
        if self._tok_root is None:
            self._tok_root = Path(tempfile.mkdtemp(prefix="wsllm-tokenizers-"))
        directory = self._tok_root / hashlib.sha256(name.encode()).hexdigest()[:16]
        directory.mkdir(exist_ok=True)
        for fname, data in files.items():
            if fname in TOKENIZER_FILES:  # names from Redis: never a path
                (directory / fname).write_bytes(data)
        return directory

    async def start(
        self, req: ChatRequest | CompletionRequest, api: str, tenant: Tenant = ANONYMOUS
    ) -> Generation:
        """Admit, tokenize and submit a checked request of `tenant` (whom its API key
        names). Raises APIError (429 `rate_limited` past the tenant's limits). The
        Generation's `resume_token` is for its client alone."""
        model, max_len = await self.resolve(req.model, tenant)
        cap = self.cfg.max_priority if tenant.max_priority is None else tenant.max_priority
        if req.priority > cap:
            raise APIError(400, "invalid_request", f"priority must be at most {cap} for this key", "priority")
        plan = (
            plan_chat(req, model.codec, model.name, self.cfg.tool_parser)
            if isinstance(req, ChatRequest)
            else None
        )
        wanted = wanted_constraint(req, plan)
        structured = None if wanted is None else await asyncio.to_thread(checked, *wanted)
        prompt_ids = await self._prompt_ids(req, model.codec, plan.template if plan else {})
        self._check_vocab(model.codec, list(req.token_bias or {}), "logit_bias")
        params = sampling_params(req, len(prompt_ids), max_len, self.cfg, structured)
        rid = f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        metrics = model.svc.metrics
        try:
            ticket = await admit(self.limiter, tenant, rid, len(prompt_ids) + params.n * params.max_tokens)
        except APIError as e:
            if e.code == "rate_limited":
                metrics.tenant_limited(tenant.name)
            raise
        try:
            gen = await self._submit(
                model, req, api, rid, prompt_ids, params, tenant.name, plan.output if plan else None
            )
        except BaseException:
            await ticket.release(0)  # never queued: nothing used
            raise

        async def release(used: int | None) -> None:
            metrics.tenant_completion(tenant.name, gen.usage.completion_tokens)
            await ticket.release(used)

        gen.on_release = release
        gen.ratelimit_headers = ticket.headers
        metrics.prompt_tokens.inc(len(prompt_ids))
        metrics.tenant_admitted(tenant.name, len(prompt_ids))
        return gen

    async def _submit(
        self,
        model: ServedModel,
        req: ChatRequest | CompletionRequest,
        api: str,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str,
        output: OutputOptions | None = None,
    ) -> Generation:
        gen = Generation(model.svc, rid, prompt_ids, params, req.stops, api, output=output)
        gen.context["model"] = model.name
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
                    model=model.name,
                    arrival_time=(now := time.time()),
                    queue_deadline=now + self.cfg.queue_timeout_s if self.cfg.queue_timeout_s else 0.0,
                    priority=req.priority,
                    tenant=tenant,
                ),
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

    async def tokenize(
        self, req: TokenizeCompletion | TokenizeChat, tenant: Tenant = ANONYMOUS
    ) -> tuple[list[int], int, TextCodec]:
        """vLLM's /tokenize: the token ids a prompt (or a chat's messages, through the
        template as a chat request would have them) gives with the named model, with its
        context length and its tokenizer."""
        model, max_len = await self.resolve(req.model, tenant)
        codec = model.codec
        if isinstance(req, TokenizeChat):
            chat = req.as_chat()
            template = plan_chat(chat, codec, model.name, self.cfg.tool_parser).template | {
                "add_generation_prompt": req.add_generation_prompt,
                "continue_final_message": req.continue_final_message,
            }
            ids = await self._prompt_ids(chat, codec, template)
        else:
            encode = functools.partial(codec.encode, add_special_tokens=req.add_special_tokens)
            ids = await self._run_text(encode, req.prompt, len(req.prompt))
        return ids, max_len, codec

    async def detokenize(self, req: Detokenize, tenant: Tenant = ANONYMOUS) -> str:
        """vLLM's /detokenize: the text of token ids of the named model."""
        model, _ = await self.resolve(req.model, tenant)
        self._check_vocab(model.codec, req.tokens, "tokens")
        decode = functools.partial(model.codec.backend.decode, skip_special_tokens=False)
        return str(await self._run_text(decode, req.tokens, 4 * len(req.tokens)))

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
            model = await self.served(str(found.context.get("model") or self.model_name))
            gen = Generation.from_context(model.svc, found.request_id, found.context)
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
        if self._tok_root is not None:
            shutil.rmtree(self._tok_root, ignore_errors=True)

    @staticmethod
    def _check_vocab(codec: TextCodec, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t >= codec.vocab_size]
        if bad:
            raise APIError(
                400,
                "invalid_request",
                f"{param}: token id {bad[0]} is not in the vocabulary (size {codec.vocab_size})",
                param=param,
            )

    async def _prompt_ids(
        self, req: ChatRequest | CompletionRequest, codec: TextCodec, template: dict[str, Any]
    ) -> list[int]:
        self._check_vocab(codec, req.stop_token_ids or [], "stop_token_ids")
        if isinstance(req, CompletionRequest):
            prompt = req.single
            if isinstance(prompt, list):
                self._check_vocab(codec, prompt, "prompt")
                return list(prompt)
            return await self._run_text(codec.encode, prompt, len(prompt))
        messages = [m.as_template_input() for m in req.messages]
        size = sum(len(m["content"]) + _MESSAGE_OVERHEAD_CHARS for m in messages)
        try:
            return await self._run_text(functools.partial(codec.encode_chat, **template), messages, size)
        except TemplateError as e:
            raise APIError(400, "invalid_request", f"messages: {e}", param="messages") from None

    @staticmethod
    async def _run_text(fn, arg, size: int):  # type: ignore[no-untyped-def]
        if size <= _TOKENIZE_INLINE_CHARS:
            return fn(arg)
        return await asyncio.to_thread(fn, arg)
