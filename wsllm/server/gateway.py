"""The gateway's core, shared by the OpenAI routes and the WebSocket: admission,
the reader task that fans TokenEvents out by request_id, and `Generation`, which
turns one request's events into text deltas (detokenization, stop strings, usage,
metrics) and aborts the engine request when the client or a stop string ends it.

With a resumable broker (Redis) a request outlives its connection: a client that
leaves detaches (`Generation.detach`), the request runs on for `resume_grace_s`, and
`Gateway.resume` rebuilds its Generation on any gateway by replaying its events
from the first one. Replaying the same events gives the same deltas, so a client
that says how many it has gets exactly the rest."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from wsllm.broker.base import Broker, BrokerClosed, BrokerUnavailable, EngineInfo, QueueFull
from wsllm.config import GatewayConfig
from wsllm.server.errors import APIError
from wsllm.server.metrics import Metrics
from wsllm.server.schemas import ChatRequest, CompletionRequest, sampling_params
from wsllm.server.text import Detokenizer, StopMatcher, TemplateError, TextCodec
from wsllm.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    Usage,
)

log = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized off the event loop.
_TOKENIZE_INLINE_CHARS = 4096
# Prompt tokens kept with a resumable request: the detokenizer's context on replay.
_CONTEXT_TAIL = 8


class Router:
    """The one reader of `broker.events()`. It routes each TokenEvent to the queue
    of its request; events of requests nobody waits for (cancelled) are dropped."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._queues: dict[str, asyncio.Queue[TokenEvent | None]] = {}

    def open(self, request_id: str) -> asyncio.Queue[TokenEvent | None]:
        # Unbounded on purpose: a request receives at most n * max_tokens events,
        # and both are capped by GatewayConfig.
        q: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str, queue: asyncio.Queue[TokenEvent | None] | None = None) -> None:
        """Stop routing `request_id`. With `queue`, only if that queue still receives
        it: a request resumed on a new connection while its old one is still closing
        belongs to the new one."""
        if queue is not None and self._queues.get(request_id) is not queue:
            return
        self._queues.pop(request_id, None)
        self.broker.forget(request_id)

    def __len__(self) -> int:
        return len(self._queues)

    def request_ids(self) -> list[str]:
        """The requests followed now (tests, debugging)."""
        return list(self._queues)

    async def run(self) -> None:
        try:
            async for batch in self.broker.events():
                for ev in batch:
                    q = self._queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
        finally:
            # The broker closed (or the app stops): nothing will feed the open requests.
            for rid, q in self._queues.items():
                q.put_nowait(
                    TokenEvent(
                        rid,
                        -1,
                        [],
                        finish_reason=FINISH_ERROR,
                        error_code="worker_lost",
                        error="the engine connection closed",
                    )
                )


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Delta:
    """New text for one choice. `finish_reason` is set on the choice's last delta."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_tokens: int = 0


class GenerationError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Choice:
    index: int
    detok: Detokenizer
    stop: StopMatcher | None
    num_tokens: int = 0
    finish_reason: str | None = None  # what the client is told
    engine_done: bool = False  # the engine sent this choice's last event


@dataclass(slots=True)
class _Timing:
    arrival: float  # time.monotonic() when the request came in
    last_event: float | None = None
    queue_time: float | None = None


class Generation:
    """One request's life in the gateway. Call `next()` until `finished`; call
    `cancel()` if the client goes away. Not safe to share between tasks except for
    `cancel()`, which wakes a pending `next()`."""

    def __init__(
        self,
        gw: Gateway,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        api: str,
        prompt_len: int | None = None,
    ) -> None:
        self.gw = gw
        self.request_id = request_id
        self.api = api
        self.prompt_len = len(prompt_ids) if prompt_len is None else prompt_len
        self.want_logprobs = params.logprobs is not None
        self.choices = [
            _Choice(i, gw.codec.detokenizer(prompt_ids), StopMatcher(stops) if stops else None)
            for i in range(params.n)
        ]
        #: what another gateway needs to rebuild this Generation (resumable brokers)
        self.context: dict[str, Any] = {
            "api": api,
            "n": params.n,
            "logprobs": params.logprobs,
            "stops": stops,
            "prompt_len": self.prompt_len,
            "prompt_tail": prompt_ids[-_CONTEXT_TAIL:],
            "created": int(time.time()),
        }
        self.cached_tokens = 0
        self.finished = False
        self._final: list[Delta] = []  # deltas produced by cancel(), handed out by next()
        self._timing = _Timing(time.monotonic())
        self._queue = gw.router.open(request_id)

    @classmethod
    def from_context(cls, gw: Gateway, request_id: str, ctx: dict[str, Any]) -> Generation:
        """A Generation for a request started elsewhere, from its stored context."""
        params = SamplingParams(n=int(ctx.get("n", 1)), logprobs=ctx.get("logprobs"))
        gen = cls(
            gw,
            request_id,
            list(ctx.get("prompt_tail", [])),
            params,
            list(ctx.get("stops", [])),
            str(ctx.get("api", "")),
            prompt_len=int(ctx.get("prompt_len", 0)),
        )
        gen.context = dict(ctx)
        return gen

    @property
    def started(self) -> bool:
        """An event came (the request left the queue)."""
        return self._timing.last_event is not None or self._timing.queue_time is not None

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_len, sum(c.num_tokens for c in self.choices), self.cached_tokens)

    async def next(self, timeout: float | None = None) -> list[Delta]:
        """The next deltas ([] when `timeout` passed first, or when finished).
        Raises GenerationError when the engine failed the request."""
        if self._final or self.finished:
            out, self._final = self._final, []
            return out
        if self._queue.empty():
            try:
                async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                    events = [await self._queue.get()]
            except TimeoutError:
                return []
        else:
            events = []
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        deltas: list[Delta] = []
        for e in events:
            if e is None or self.finished:  # woken by cancel()
                break
            deltas.extend(self._on_event(e))
            if all(c.finish_reason is not None for c in self.choices):
                await self._end()
        deltas.extend(self._final)
        self._final = []
        # Resumable: one delta per event, so that a replay on any gateway numbers them
        # the same way (the transports then send one message per delta).
        return deltas if self.gw.broker.resumable else _merge(deltas)

    async def cancel(self) -> None:
        """The client went away or asked to stop: free the engine request now. The
        abort is with the broker when this returns."""
        if self.finished:
            return
        self._final = [Delta(c.index, "", FINISH_ABORT) for c in self.choices if c.finish_reason is None]
        for c in self.choices:
            c.finish_reason = c.finish_reason or FINISH_ABORT
        self.gw.metrics.aborts.inc()
        await self._end()
        self._queue.put_nowait(None)

    def detach(self) -> None:
        """The client left, and the broker keeps the request for a resume: stop
        following it here and abort it after `resume_grace_s` unless a client resumed
        it by then (on any gateway)."""
        if self.finished:
            return
        self.finished = True
        self.gw.router.close(self.request_id, self._queue)
        self._queue.put_nowait(None)
        self.gw.abort_later(self.request_id)

    def _on_event(self, ev: TokenEvent) -> list[Delta]:
        if ev.index < 0 and ev.finish_reason == FINISH_ABORT:  # the whole request was cancelled
            return [self._abort_choice(c) for c in self.choices if c.finish_reason is None]
        if ev.finish_reason == FINISH_ERROR or not 0 <= ev.index < len(self.choices):
            self.finished = True
            self.gw.router.close(self.request_id, self._queue)
            raise GenerationError(
                ev.error_code or "internal_error", ev.error or f"bad event for choice {ev.index}"
            )
        self._observe(ev)
        c = self.choices[ev.index]
        if ev.usage is not None:
            self.cached_tokens = max(self.cached_tokens, ev.usage.cached_tokens)
        if c.finish_reason is not None:  # ended by a stop string; the engine hasn't heard yet
            c.engine_done = c.engine_done or ev.finish_reason is not None
            return []
        c.num_tokens += len(ev.token_ids)
        text = c.detok.feed(ev.token_ids)
        if c.stop is not None:
            text, matched = c.stop.feed(text)
            if not matched and ev.finish_reason is not None:
                tail, matched = c.stop.flush()
                text += tail
            if matched:
                c.finish_reason = FINISH_STOP
        if ev.finish_reason is not None:
            c.engine_done = True
            c.finish_reason = c.finish_reason or ev.finish_reason
        return [Delta(c.index, text, c.finish_reason, self._logprobs(ev), len(ev.token_ids))]

    @staticmethod
    def _abort_choice(c: _Choice) -> Delta:
        c.finish_reason = FINISH_ABORT
        c.engine_done = True
        return Delta(c.index, "", FINISH_ABORT)

    async def _end(self) -> None:
        self.finished = True
        if not all(c.engine_done for c in self.choices):
            # A stop string or the client ended it while the engine still runs it.
            await self.gw.broker.abort(self.request_id)
        self.gw.router.close(self.request_id, self._queue)
        m = self.gw.metrics
        m.e2e.observe(time.monotonic() - self._timing.arrival)
        m.generation_tokens.inc(sum(c.num_tokens for c in self.choices))
        m.finished(self.api, self.choices[0].finish_reason or FINISH_ABORT)

    def _observe(self, ev: TokenEvent) -> None:
        t = self._timing
        now = time.monotonic()
        if ev.token_ids:
            if t.last_event is None:
                self.gw.metrics.ttft.observe(now - t.arrival)
            else:
                self.gw.metrics.itl.observe(now - t.last_event)
            t.last_event = now
        if ev.queue_time is not None and t.queue_time is None:
            t.queue_time = ev.queue_time
            self.gw.metrics.queue.observe(ev.queue_time)

    def _logprobs(self, ev: TokenEvent) -> list[TokenLogprob] | None:
        if not self.want_logprobs or not ev.logprobs:
            return None
        text = self.gw.codec.token_text
        return [
            TokenLogprob(text(tid), float(lp), [(text(int(t)), float(tlp)) for t, tlp in top])
            for tid, (lp, top) in zip(ev.token_ids, ev.logprobs, strict=False)
        ]


def _merge(deltas: list[Delta]) -> list[Delta]:
    """One delta per choice: events that queued up while the client was slow go out
    together (clients expect a choice at most once per chunk)."""
    by_index: dict[int, Delta] = {}
    for d in deltas:
        m = by_index.get(d.index)
        if m is None:
            by_index[d.index] = d
            continue
        m.text += d.text
        m.num_tokens += d.num_tokens
        m.finish_reason = d.finish_reason or m.finish_reason
        if d.logprobs:
            m.logprobs = (m.logprobs or []) + d.logprobs
    return list(by_index.values())


@dataclass
class Gateway:
    cfg: GatewayConfig
    broker: Broker
    codec: TextCodec
    model_name: str
    metrics: Metrics
    router: Router = field(init=False)
    _later: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.router = Router(self.broker)

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
        self,
        req: ChatRequest | CompletionRequest,
        api: str,
        request_id: str | None = None,
        alias: str | None = None,
    ) -> Generation:
        """Admit, tokenize and submit a checked request. Raises APIError. `alias` (a
        WebSocket id) finds the request again for a resume on a resumable broker."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                "model_not_found",
                f"model {req.model!r} is not served here; try {self.model_name!r}",
                param="model",
            )
        engines = await self.engines()
        if not engines:
            raise APIError(503, "model_not_ready", "no engine is serving this model yet", retry_after=1)
        prompt_ids = await self._prompt_ids(req)
        max_len = min(e.max_model_len for e in engines)
        params = sampling_params(req, len(prompt_ids), max_len, self.cfg)
        rid = request_id or f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        gen = Generation(self, rid, prompt_ids, params, req.stops, api)
        gen.context["include_usage"] = bool(getattr(req, "include_usage", False))
        try:
            await self.broker.submit(
                GenerateRequest(rid, prompt_ids, params, model=self.model_name, arrival_time=time.time()),
                max_waiting=self.cfg.max_queue_depth,
                context=gen.context if self.broker.resumable else None,
                alias=alias,
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
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen

    async def resume(self, key: str) -> Generation | None:
        """The Generation of a request started on any gateway (`key`: its id or its
        WebSocket alias), replaying its events from the first; None when the broker
        does not know it (or cannot resume at all)."""
        if not self.broker.resumable:
            return None
        try:
            found = await self.broker.lookup(key)
            if found is None:
                return None
            gen = Generation.from_context(self, found.request_id, found.context)
            await self.broker.follow(found.request_id)
        except BrokerUnavailable:
            raise APIError(
                503, "model_not_ready", "the broker is unreachable; retry", retry_after=1
            ) from None
        return gen

    def abort_later(self, request_id: str) -> None:
        """Abort a detached request after the grace time, unless it was resumed."""

        async def later() -> None:
            await asyncio.sleep(self.broker.resume_grace_s)
            try:
                if await self.broker.abort_unless_resumed(request_id):
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
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._run_text(self.codec.encode_chat, messages, size)
        except TemplateError as e:
            raise APIError(400, "invalid_request", f"messages: {e}", param="messages") from None

    @staticmethod
    async def _run_text(fn, arg, size: int):  # type: ignore[no-untyped-def]
        if size <= _TOKENIZE_INLINE_CHARS:
            return fn(arg)
        return await asyncio.to_thread(fn, arg)
