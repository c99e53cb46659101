"""A tenant's limits at admission: take from its buckets (or refuse with 429), and the
`x-ratelimit-*` headers OpenAI sends.

A request is admitted before the gateway does any work for it that a tenant could
multiply (tokenizing, compiling a grammar): one request from rpm, a concurrency lease,
and a coarse token charge (`coarse_charge`: the prompt's size estimated from its text,
plus `width x max_tokens`). After preparation the charge is set to the exact one
(`exact_charge`: the prompt's tokens plus `width x` the `max_tokens` the engine will
use), the difference taken or given back (`Ticket.refine`). `width` is the number of
sequences generated at once: `n`, or the beam width of a beam search. A charge larger
than the tenant's whole tpm can never pass: a 429 that says so, at once.

When the request ends in this gateway (finished, failed, cancelled) the unused part,
the charge minus the prompt and completion tokens it really used, goes back with the
lease. A request whose client left while it runs on for a resume (Redis) keeps its
lease until its grace abort, and is not refunded: its tokens are still being made.
A call that generates nothing (`/tokenize`, `count_tokens`) is admitted the same way,
with its prompt's coarse charge, and settles at its exact token count (`Ticket.settle`).
Resumes take one request from rpm (`meter_call`) and the lease again. An HTTP call takes its
first request of rpm before its body is read (`take_request`: a key past its rpm costs the
gateway no read and no validation), a WebSocket one at its handshake; admission then takes
the rest (`admit(..., paid=)`). The rules of the buckets are in `wsllm/broker/limits.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from wsllm.broker.base import BrokerError
from wsllm.broker.limits import (
    REASON_CONCURRENT,
    REASON_REQUESTS,
    Decision,
    Limiter,
    Limits,
    refill_time_s,
)
from wsllm.server.errors import APIError
from wsllm.server.metrics import Metrics
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.tenants import Tenant
from wsllm.types import ERR_RATE_LIMITED, SamplingParams

log = logging.getLogger(__name__)

# The coarse estimate of a text's tokens: about 4 bytes a token for English with the
# usual BPE vocabularies, a token a digit (they split numbers digit by digit: a digit string
# charged at 4 bytes a token reached 4.5x a key's tpm in a burst) and 2 bytes a token of
# other scripts (a CJK character, 3 bytes, is 1-1.5 tokens); the exact charge after
# tokenizing corrects it either way.
_BYTES_PER_TOKEN = 4
_NON_ASCII_BYTES_PER_TOKEN = 2
_MESSAGE_OVERHEAD_TOKENS = 4  # a chat message's role and template markers
# An image's placeholder tokens before its model's processor counts them: SmolVLM's
# 512-pixel tiles are 64 tokens each, up to 17 of them; the exact charge corrects it.
_IMAGE_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Coarse:
    """A request's token charge before tokenizing."""

    estimate: int  # taken at admission, set right after tokenizing
    least: int  # what the exact charge cannot be below: over the tpm, it can never pass


@dataclass(frozen=True, slots=True)
class Charge:
    """What a call asks of its tenant before any work is done for it: the model it
    names, its priority, and a coarse token charge per engine request it makes (one,
    or one per prompt of a list, per embeddings input; one for a call that generates
    nothing). Each is admitted (rpm, a lease, the tokens) before the call's work."""

    model: str | None
    coarse: list[Coarse]
    priority: int = 0


def coarse_charge(req: ChatRequest | CompletionRequest, default_max_tokens: int) -> Coarse:
    """A request's token charge before tokenizing: its prompt's size in tokens,
    estimated from the text (exact for token ids; a fill-in-the-middle `suffix` counts
    too), twice with prompt logprobs, plus `width x max_tokens` (the client's, or the default; the context may lower
    it, which the exact charge tells)."""
    if isinstance(req, CompletionRequest):
        p = req.single
        known = len(p) if isinstance(p, list) else 0
        prompt = text_tokens(p) if isinstance(p, str) else known
        prompt += text_tokens(req.suffix) if req.suffix is not None else 0
    else:
        known, prompt = 0, chat_prompt_tokens(req)
    if getattr(req, "prompt_logprobs", None) is not None:  # a second pass over the prompt, as exact_charge
        known, prompt = 2 * known, 2 * prompt
    max_tokens = req.requested_max_tokens
    width = req.n or 1
    if isinstance(req, CompletionRequest) and req.use_beam_search:
        width = req.beam_width or max(4, width)  # as prepare's beam fields set it
    estimate = prompt + width * (default_max_tokens if max_tokens is None else max_tokens)
    return Coarse(estimate, known + width * (max_tokens or 1))


def chat_prompt_tokens(req: ChatRequest) -> int:
    """A chat prompt's tokens, estimated from its messages' and tools' text and its images."""
    prompt = sum(text_tokens(m.text) + _MESSAGE_OVERHEAD_TOKENS for m in req.messages)
    prompt += _IMAGE_TOKENS * sum(len(m.image_parts) for m in req.messages)
    return prompt + sum(text_tokens(t.model_dump_json()) for t in req.tools or [])


def text_tokens(text: str) -> int:
    """A text's tokens, estimated from its bytes: never far below what the usual
    tokenizers make of it (digits and other scripts are denser than English)."""
    raw = text.encode("utf-8", "surrogatepass")
    digits = sum(1 for c in text if "0" <= c <= "9")
    wide = len(raw) - len(text.encode("ascii", "ignore"))  # the bytes of non-ASCII characters
    rest = len(raw) - wide - digits
    return digits + -(-wide // _NON_ASCII_BYTES_PER_TOKEN) + -(-rest // _BYTES_PER_TOKEN)


def prompt_charge(tokens: int, exact: bool = False) -> Coarse:
    """The charge of a call that generates nothing and reads a prompt of about `tokens`
    (`exact`: token ids, whose number is known)."""
    return Coarse(tokens, tokens if exact else 0)


def exact_charge(prompt_tokens: int, params: SamplingParams, compile_tokens: int = 0) -> int:
    """A prepared request's token charge: its prompt plus what it may generate, every
    sequence generated at once (a beam search's width, not its `n`), and with prompt
    logprobs its prompt once more: each row's lm_head, log_softmax and top-k is about a
    token's work, which the engine's step budget counts too (`prompt_logprob_cost`);
    plus `compile_tokens`, its structured-output spec's compile (`compile_charge`)."""
    width = params.beam_width if params.use_beam_search else params.n
    return prompt_tokens + kept_charge(prompt_tokens, params, compile_tokens) + width * params.max_tokens


def kept_charge(prompt_tokens: int, params: SamplingParams, compile_tokens: int = 0) -> int:
    """The part of `exact_charge` that is work done whatever the request then uses (its
    prompt-logprob rows, its spec's compile): no refund gives it back."""
    rows = prompt_tokens if params.prompt_logprobs is not None else 0
    return rows + compile_tokens


def compile_charge(compile_s: float, tokens_per_s: int) -> int:
    """Tokens for the seconds the gateway spent compiling a spec, at `tokens_per_s`
    (GatewayConfig.spec_compile_tokens_per_s)."""
    return math.ceil(compile_s * tokens_per_s)


def too_large(tenant: Tenant, tokens: int) -> APIError | None:
    """The 429 of a charge larger than the tenant's whole tpm (it could never pass)."""
    tpm = tenant.limits.tpm
    if tpm is None or tokens <= tpm:
        return None
    return APIError(
        429,
        ERR_RATE_LIMITED,
        f"this request is charged {tokens} tokens (its prompt, again with prompt_logprobs, plus n or beam_width x max_tokens, "
        "plus its structured-output spec's compile time), "
        f"more than tenant {tenant.name!r} may use in a minute ({tpm} tokens per minute); "
        "it can never pass: lower max_tokens, n or beam_width",
    )


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `250ms`, `12s`, `1m30s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def ratelimit_headers(tenant: Tenant, d: Decision) -> dict[str, str]:
    """`x-ratelimit-*` for the limits the tenant has (none for an unlimited one)."""
    out: dict[str, str] = {}
    lim = tenant.limits
    if lim.rpm is not None and d.remaining_requests is not None:
        out["x-ratelimit-limit-requests"] = str(lim.rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, d.remaining_requests))
        out["x-ratelimit-reset-requests"] = _duration(d.reset_requests_s or 0.0)
    if lim.tpm is not None and d.remaining_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(lim.tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, d.remaining_tokens))
        out["x-ratelimit-reset-tokens"] = _duration(d.reset_tokens_s or 0.0)
    return out


def refused(tenant: Tenant, d: Decision, tokens: int) -> APIError:
    lim = tenant.limits
    if d.reason == REASON_CONCURRENT:
        what = f"{lim.max_concurrent} requests at once"
    elif d.reason == REASON_REQUESTS:
        what = f"{lim.rpm} requests per minute"
    else:
        what = f"{lim.tpm} tokens per minute (this request is charged {tokens})"
    retry = max(1, math.ceil(d.retry_after_s))
    return APIError(
        429,
        ERR_RATE_LIMITED,
        f"rate limit reached for tenant {tenant.name!r}: {what}; retry in {retry}s",
        retry_after=retry,
        headers=ratelimit_headers(tenant, d),
    )


@dataclass(slots=True)
class Ticket:
    """What one admitted request took; `release` gives back what it did not use."""

    limiter: Limiter | None
    tenant: Tenant
    request_id: str
    decision: Decision
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False
    charged: int = 0  # tokens taken from the tokens bucket so far
    # of `charged`, work done whatever the request then uses (its prompt-logprob rows, its
    # spec's compile): `release` never refunds it
    kept: int = 0

    def __post_init__(self) -> None:
        self.charged = self.decision.charged

    async def refine(self, tokens: int, refuse: bool = True) -> None:
        """Set the charge to `tokens`, the exact one now that the prompt is tokenized:
        take the difference, or give it back. Raises the 429 of a charge larger than
        the tenant's tpm (the ticket is then released, nothing refunded but the
        generation part), unless not `refuse` (the work is done: it is taken, a debt)."""
        err = too_large(self.tenant, tokens) if refuse else None
        if err is not None:
            raise err
        tpm = self.tenant.limits.tpm
        if self.limiter is None or not tpm or tokens == self.charged:
            return
        level = await self.limiter.adjust(self.tenant.name, self.tenant.limits, tokens - self.charged)
        self.charged = tokens
        self.decision = dataclasses.replace(
            self.decision, remaining_tokens=math.floor(level), reset_tokens_s=refill_time_s(level, tpm)
        )
        self.headers = ratelimit_headers(self.tenant, self.decision)

    def hand_over(self) -> None:
        """The request was resumed: whoever resumed it holds its lease now. This
        gateway stops keeping it alive; nothing is given back."""
        if not self.released and self.limiter is not None:
            self.limiter.hand_over(self.tenant.name, self.request_id)
        self.released = True

    async def settle(self, tokens: int) -> None:
        """A call that generates nothing is done, its exact charge `tokens`: taken (even
        below zero: the work is done, the tenant's next calls wait for the bucket), and
        its lease released."""
        try:
            await self.refine(tokens, refuse=False)
        except BrokerError:  # the answer is computed: a broker fault does not withhold it
            log.warning("could not charge %d tokens to tenant %s", tokens, self.tenant.name)
        await self.release(tokens)

    async def release(self, used_tokens: int | None) -> None:
        """The request ended here. `used_tokens` (prompt + completion) sets the refund;
        None: no refund (the request runs on without this gateway). Once only."""
        if self.released or self.limiter is None:
            self.released = True
            return
        self.released = True
        refund = 0 if used_tokens is None else max(0, self.charged - self.kept - used_tokens)
        try:
            await self.limiter.release(self.tenant.name, self.tenant.limits, self.request_id, refund)
        except BrokerError:  # the lease expires by itself (Redis); the refund is lost
            log.warning("could not release request %s of tenant %s", self.request_id, self.tenant.name)


async def admit(
    limiter: Limiter,
    tenant: Tenant,
    request_id: str,
    tokens: int,
    least: int | None = None,
    paid: Decision | None = None,
) -> Ticket:
    """Take the request's share of the tenant's limits, or raise a 429 APIError. A
    charge that is an estimate (`least`: what the exact one cannot be below) is refused
    as too large only when `least` is; an estimate over the whole bucket takes the whole
    bucket, `min(estimate, tpm)`, for now (the prompt is often fewer tokens than its
    bytes tell), and `Ticket.refine` decides. Taking less would let every concurrent
    request of the tenant in on almost nothing and drive the bucket into a debt once
    per request when their exact charges come (tpm 1,000, 8 at once: -5,656). `paid`: its
    request of rpm was taken already (`take_request`), whose figures its headers carry."""
    err = too_large(tenant, tokens if least is None else least)
    if err is not None:
        raise err
    tpm = tenant.limits.tpm
    take = min(tokens, tpm) if tpm is not None else tokens
    limits = tenant.limits if paid is None else dataclasses.replace(tenant.limits, rpm=None)
    ticket = await _take(limiter, tenant, limits, request_id, take)
    if paid is not None:
        ticket.decision = dataclasses.replace(
            ticket.decision,
            remaining_requests=paid.remaining_requests,
            reset_requests_s=paid.reset_requests_s,
        )
        ticket.headers = ratelimit_headers(tenant, ticket.decision)
    return ticket


def check_priority(priority: int, tenant: Tenant, default_cap: int) -> None:
    """A 400 when `priority` is over what the tenant's key may ask (its own cap, else
    the gateway's --max-priority)."""
    cap = default_cap if tenant.max_priority is None else tenant.max_priority
    if priority > cap:
        raise APIError(400, "invalid_request", f"priority must be at most {cap} for this key", "priority")


@contextlib.contextmanager
def counted(metrics: Metrics, tenant: Tenant) -> Iterator[None]:
    """Count a 429 of `tenant` raised inside (wsllm_tenant_rate_limited_total)."""
    try:
        yield
    except APIError as e:
        if e.code == ERR_RATE_LIMITED:
            metrics.tenant_limited(tenant.name)
        raise


async def meter_call(limiter: Limiter, tenant: Tenant) -> dict[str, str]:
    """Take one request from the tenant's rpm for a resume's replay, or raise a 429
    APIError. Its x-ratelimit-* headers."""
    paid = await take_request(limiter, tenant)
    return {} if paid is None else ratelimit_headers(tenant, paid)


async def take_request(limiter: Limiter, tenant: Tenant) -> Decision | None:
    """One request of the tenant's rpm, before anything is read or done for the call, or
    a 429 APIError; None for a tenant without an rpm."""
    if tenant.limits.rpm is None:
        return None
    ticket = await _take(limiter, tenant, Limits(rpm=tenant.limits.rpm), "", 0)
    return ticket.decision


async def take_lease(limiter: Limiter, tenant: Tenant, request_id: str) -> Ticket:
    """A concurrency lease for a request resumed by its client (its rpm is taken by
    `meter_call`, its tokens were charged when it started)."""
    return await _take(limiter, tenant, Limits(max_concurrent=tenant.limits.max_concurrent), request_id, 0)


async def _take(limiter: Limiter, tenant: Tenant, limits: Limits, request_id: str, tokens: int) -> Ticket:
    if limits.unlimited:
        return Ticket(None, tenant, request_id, Decision(allowed=True))
    d = await limiter.acquire(tenant.name, limits, request_id, tokens)
    if not d.allowed:
        raise refused(tenant, d, tokens)
    return Ticket(limiter, tenant, request_id, d, ratelimit_headers(tenant, d))
