"""One request's text work in the gateway: its TokenEvents become text deltas
(detokenization, stop strings, logprobs, usage, metrics), and the engine request is
aborted when the client, a stop string or a failure ends it first. A chat answer's
text is then split into reasoning, content and tool calls (chat/output.py).

What a Generation needs is handed to it (`Services`: the codec, the metrics, the
broker, the router and the grace-abort scheduler), not reached through the gateway.
A transport whose client goes away calls `leave()`: the Generation knows whether its
request outlives the connection (a resumable broker: detach) or not (cancel)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from wsllm.broker.base import GatewayBroker
from wsllm.server.chat.output import ChoiceOutput, OutputOptions
from wsllm.server.chat.reasoning import prompt_opens_think
from wsllm.server.delta import Delta, TokenLogprob, merge
from wsllm.server.metrics import Metrics
from wsllm.server.resume import ResumeContext
from wsllm.server.router import Router
from wsllm.server.text import Detokenizer, StopMatcher, TextCodec
from wsllm.types import (
    ERR_INTERNAL,
    ERR_RESUMED_ELSEWHERE,
    ERR_SLOW_CONSUMER,
    ERR_WORKER_LOST,
    FINISH_ABORT,
    FINISH_STOP,
    SamplingParams,
    TokenEvent,
    Usage,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Services:
    """What every Generation of a gateway uses."""

    codec: TextCodec
    metrics: Metrics
    broker: GatewayBroker
    router: Router
    #: abort_later(request_id, attach, after): abort a detached request after the grace
    #: time, then `after(aborted)` (the tenant's lease: dropped, or handed to the resumer)
    abort_later: Callable[[str, int, Callable[[bool], Awaitable[None]] | None], None]


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
    out: ChoiceOutput | None  # chat: reasoning and tool-call parsing
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
    `leave()` if the client goes away, `cancel()` if it asks to stop. Not safe to
    share between tasks except for `cancel()`, which wakes a pending `next()`."""

    def __init__(
        self,
        svc: Services,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        ctx: ResumeContext,
    ) -> None:
        """A request whose prompt ends with `prompt_ids` (all of them, or the context's
        tail after a resume); `ctx` says how its answer is read."""
        self.svc = svc
        self.request_id = request_id
        self.want_logprobs = params.logprobs is not None
        self.prompt_ids_for_logprobs = prompt_ids if params.prompt_logprobs is not None else []
        #: per prompt token (None for the first), as the engine sent them (token ids): kept
        #: once, from its first event, and rendered by the transport off the event loop
        self.prompt_logprobs_raw: list[Any] | None = None
        #: an embedding request's pooled vector (params.pooling), from its final event
        self.embedding: list[float] | None = None
        if ctx.output is None and ctx.api.is_chat:
            ctx.output = OutputOptions()  # no tools; <think> split off
        output = ctx.output
        in_think = (
            output is not None and output.reasoning and prompt_opens_think(svc.codec.prompt_tail(prompt_ids))
        )
        stops = ctx.stops
        self.choices = [
            _Choice(
                i,
                svc.codec.detokenizer(prompt_ids, output is not None and output.whole_answer),
                StopMatcher(stops) if stops else None,
                ChoiceOutput(output, f"{request_id}/{i}", in_think) if output is not None else None,
            )
            for i in range(params.n)
        ]
        #: what another gateway needs to rebuild this Generation (resumable brokers)
        self.context = ctx
        self.resume_token: str | None = None  # handed to the client that started it
        #: set at admission: hands back the tenant's concurrency lease and the unused part
        #: of its token charge (given the tokens used; None: no refund). Called once.
        self.on_release: Callable[[int | None], Awaitable[None]] | None = None
        #: set at admission: the request was resumed, whoever resumed it holds its lease now
        self.on_hand_over: Callable[[], None] | None = None
        #: x-ratelimit-* headers of the tenant's limits after admission
        self.ratelimit_headers: dict[str, str] = {}
        self.attach = 0  # how many resumes came before this one (the broker counts)
        self.cached_tokens = 0
        self.drafted = (0, 0)  # speculative decoding: (draft tokens verified, accepted), the latest
        self.finished = False
        self._retired = False  # its events dropped from the broker (`_retire`)
        self._final: list[Delta] = []  # deltas produced by cancel(), handed out by next()
        self._timing = _Timing(time.monotonic())
        self._inbox = svc.router.open(request_id, ctx.model)

    @classmethod
    def from_context(cls, svc: Services, request_id: str, ctx: ResumeContext) -> Generation:
        """A Generation for a request started elsewhere, from its stored context."""
        return cls(svc, request_id, ctx.prompt_tail, SamplingParams(n=ctx.n, logprobs=ctx.logprobs), ctx)

    @property
    def prompt_len(self) -> int:
        return self.context.prompt_len

    @property
    def started(self) -> bool:
        """An event came (the request left the queue)."""
        return self._timing.last_event is not None or self._timing.queue_time is not None

    @property
    def usage(self) -> Usage:
        num = sum(c.num_tokens for c in self.choices)
        return Usage(self.prompt_len, num, self.cached_tokens, *self.drafted)

    @property
    def replayable(self) -> bool:
        """Its deltas are numbered for a replay (a resumable broker): one per engine event,
        so a resume on any gateway numbers them the same; a transport sends each alone."""
        return self.svc.broker.resumable

    def queue_poll_s(self) -> float | None:
        """How often its client may be told its place in the queue (`position`) while it
        waits; None once it started, or where the broker cannot tell."""
        waiting = self.svc.broker.resumable and not self.started and not self.finished
        return self.svc.broker.queue_poll_s if waiting else None

    async def position(self) -> int | None:
        """Its 1-based place in its queue (0: an engine took it; None: unknown)."""
        return await self.svc.broker.position(self.request_id)

    async def next(self, timeout: float | None = None) -> list[Delta]:
        """The next deltas ([] when `timeout` passed first, or when finished).
        Raises GenerationError when the request failed."""
        if self._final or self.finished:
            out, self._final = self._final, []
            return out
        if self._inbox.overflowed:
            await self._fail(ERR_SLOW_CONSUMER, "the client fell too far behind this stream")
        if self._inbox.orphaned is not None:  # the router's deadline: nothing will answer it
            await self._fail(ERR_WORKER_LOST, f"this request was lost: {self._inbox.orphaned}", lost=True)
        events = await self._inbox.take(timeout)
        if not events and not self.finished and not self.svc.router.routes_to(self.request_id, self._inbox):
            self.finished = True  # its owner resumed it elsewhere: that reader has it now
            raise GenerationError(ERR_RESUMED_ELSEWHERE, "this request was resumed on another connection")
        deltas: list[Delta] = []
        for e in events:
            if self.finished:
                break
            try:
                deltas.extend(self._on_event(e))
            except GenerationError:
                raise
            except Exception:  # a malformed event costs this request only
                log.exception("request %s: cannot process an event", self.request_id)
                await self._fail(ERR_INTERNAL, "the gateway could not process this request's output")
            if all(c.finish_reason is not None for c in self.choices):
                await self._end()
        deltas.extend(self._final)
        self._final = []
        return deltas if self.replayable else merge(deltas)

    async def cancel(self) -> None:
        """The client asked to stop (or went away, and the request cannot outlive its
        connection): free the engine request now. The abort is with the broker when
        this returns. A transport calls it (or `leave`) once it sent what it had: a
        finished request's whole answer is then with its client, and its events go from
        the broker (`retire`: nobody will resume it)."""
        if self.finished:
            await self._release(self.usage.total_tokens)
            await self._retire()
            return
        self._final = [Delta(c.index, "", FINISH_ABORT) for c in self.choices if c.finish_reason is None]
        for c in self.choices:
            c.finish_reason = c.finish_reason or FINISH_ABORT
        self.svc.metrics.aborts.inc()
        await self._end()
        self._inbox.wake()

    def detach(self) -> None:
        """The client left, and the broker keeps the request for a resume: stop
        following it here and abort it after the grace time unless its owner resumed
        it by then (on any gateway)."""
        if self.finished:
            return
        self.finished = True
        self.svc.router.close(self.request_id, self._inbox)
        self._inbox.wake()
        # The request runs on: it keeps its tenant's lease (max_concurrent) until the
        # grace abort, and no tokens come back (they are still being made).
        release, hand_over = self.on_release, self.on_hand_over
        self.on_release = self.on_hand_over = None

        async def after_grace(aborted: bool) -> None:
            if aborted and release is not None:
                await release(None)
            elif not aborted and hand_over is not None:
                hand_over()

        self.svc.abort_later(self.request_id, self.attach, after_grace)

    async def leave(self) -> None:
        """The client went away: detach the request (a resumable broker keeps it for
        a resume) or cancel it. Nothing when it finished (but its limits are released)."""
        if not self.finished and self.svc.broker.resumable:
            self.detach()
            return
        await self.cancel()

    async def _retire(self) -> None:
        whole = all(c.finish_reason not in (None, FINISH_ABORT) for c in self.choices)
        if not whole or self._retired:
            return
        self._retired = True
        try:
            await self.svc.broker.retire(self.request_id, self.context.model, self.context.tenant)
        except Exception as e:  # its events expire after the retention instead
            log.warning("request %s: could not drop its events (%s)", self.request_id, e)

    async def _release(self, used_tokens: int | None) -> None:
        release, self.on_release = self.on_release, None
        if release is not None:
            try:
                await release(used_tokens)
            except Exception:
                log.exception("request %s: could not release its tenant's limits", self.request_id)

    async def _fail(self, code: str, message: str, lost: bool = False) -> None:
        """End the request here with an error: the engine stops it, the client is told.
        `lost`: nothing answers it any more, and its resume token dies with it."""
        self.svc.metrics.error(code)
        await self._end(lost)
        raise GenerationError(code, message)

    def _on_event(self, ev: TokenEvent) -> list[Delta]:
        if ev.whole_request and ev.finish_reason == FINISH_ABORT:  # the whole request was cancelled
            return [self._abort_choice(c) for c in self.choices if c.finish_reason is None]
        if ev.ends_request or not 0 <= ev.index < len(self.choices):
            self.finished = True
            self.svc.router.close(self.request_id, self._inbox)
            raise GenerationError(
                ev.error_code or ERR_INTERNAL, ev.error or f"bad event for choice {ev.index}"
            )
        self._observe(ev)
        if ev.prompt_logprobs is not None and self.prompt_logprobs_raw is None:  # a replay sends them again
            self.prompt_logprobs_raw = ev.prompt_logprobs
        c = self.choices[ev.index]
        if ev.usage is not None:
            self.cached_tokens = max(self.cached_tokens, ev.usage.cached_tokens)
            self.drafted = max(self.drafted, (ev.usage.drafted_tokens, ev.usage.accepted_tokens))
        if ev.embedding is not None:
            self.embedding = ev.embedding
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
        delta = Delta(
            c.index, text, c.finish_reason, self._logprobs(ev), len(ev.token_ids), token_ids=ev.token_ids
        )
        if c.out is not None:
            piece = c.out.feed(text, final=c.finish_reason is not None)
            delta.text, delta.reasoning, delta.tool_calls = (
                piece.content,
                piece.reasoning,
                piece.tool_calls or None,
            )
            if c.finish_reason is not None:
                delta.finish_reason = c.out.finish_reason(c.finish_reason)
        return [delta]

    @staticmethod
    def _abort_choice(c: _Choice) -> Delta:
        c.finish_reason = FINISH_ABORT
        c.engine_done = True
        return Delta(c.index, "", FINISH_ABORT)

    async def _end(self, lost: bool = False) -> None:
        """The request is over for its client (however the broker answers): the engine
        is told to stop it if it still runs it, and the tenant's limits are released."""
        if self.finished:
            return
        self.finished = True
        try:
            if not all(c.engine_done for c in self.choices):
                # A stop string, the client or a failure ended it while the engine still runs it.
                await self._abort(lost)
        finally:
            self.svc.router.close(self.request_id, self._inbox)
            await self._release(self.usage.total_tokens)
        m = self.svc.metrics
        m.e2e.observe(time.monotonic() - self._timing.arrival)
        m.generation_tokens.inc(sum(c.num_tokens for c in self.choices))
        first = self.choices[0]
        reason = first.finish_reason or FINISH_ABORT
        # as the client was told it: a chat answer that made calls ended with "tool_calls"
        m.finished(
            self.context.api.value, first.out.finish_reason(reason) if first.out is not None else reason
        )

    async def _abort(self, lost: bool) -> None:
        """Stop the engine's copy of the request. A broker that fails here must not
        keep the client from its `done` or `error`: the abort is tried again after the
        grace time (and the engine's own deadlines end the request meanwhile)."""
        broker = self.svc.broker
        try:
            await (broker.abort_lost if lost else broker.abort)(self.request_id)
        except Exception as e:  # BrokerError, or whatever else the store raised
            log.warning("request %s: the abort failed (%s); retrying it later", self.request_id, e)
            self.svc.abort_later(self.request_id, self.attach, None)

    def _observe(self, ev: TokenEvent) -> None:
        t = self._timing
        now = time.monotonic()
        if ev.token_ids:
            if t.last_event is None:
                self.svc.metrics.ttft.observe(now - t.arrival)
            else:
                self.svc.metrics.itl.observe(now - t.last_event)
            t.last_event = now
        if ev.queue_time is not None and t.queue_time is None:
            t.queue_time = ev.queue_time
            self.svc.metrics.queue.observe(ev.queue_time)

    def token_text(self, token_id: int) -> str:
        """One token's text, as its logprobs show it."""
        return self.svc.codec.token_text(token_id)

    def _logprobs(self, ev: TokenEvent) -> list[TokenLogprob] | None:
        if not self.want_logprobs or not ev.logprobs:
            return None
        text = self.token_text
        return [
            TokenLogprob(text(tid), float(lp), [(text(int(t)), float(tlp)) for t, tlp in top])
            for tid, (lp, top) in zip(ev.token_ids, ev.logprobs, strict=False)
        ]
