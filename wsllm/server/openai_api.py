"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, and
`GET /v1/streams/{id}` to resume a cut SSE stream (resumable brokers).

A resumable stream must number its events the same way on every gateway, so with
such a broker each delta is its own event (the `id:` of an event is a pure function
of the request's engine events); otherwise a slow reader gets fewer, larger chunks.
A streamed answer carries its resume token in the `X-Resume-Token` header: reading
the stream again needs it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.server.chat.output import assemble_tool_calls
from wsllm.server.errors import APIError, from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Delta, Generation, GenerationError, TokenLogprob
from wsllm.server.middleware import request_tenant
from wsllm.server.schemas import ChatRequest, CompletionRequest, validate_http
from wsllm.server.sse import DONE, KEEPALIVE, EventStream, frame, until_disconnect
from wsllm.server.tenants import Tenant
from wsllm.types import Usage

RESUME_TOKEN_HEADER = "x-resume-token"
# Bodies larger than this are validated off the event loop.
_VALIDATE_INLINE_BYTES = 64 * 1024
_EVENT_ID = re.compile(r"[0-9]{1,15}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, "body_too_large", f"the body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, "body_too_large", f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_extras(reasoning: str, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A chat message's (or delta's) reasoning_content and tool_calls, when it has them."""
    out: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
    return out | ({"tool_calls": tool_calls} if tool_calls else {})


def _chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token: str, lp: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {
        "content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]} for t in lps]
    }


def _completion_logprobs(lps: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [None if t.logprob is None else dict(t.top) for t in lps],
        "text_offset": offsets,
    }


def _vllm_prompt_logprobs(gen: Generation) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else
    {token id: {"logprob", "rank" (in the top list), "decoded_token"}} for the prompt's
    token and the top ones."""
    raw = gen.prompt_logprobs_raw
    if raw is None:
        return None
    text = gen.svc.codec.token_text
    out: list[dict[str, Any] | None] = []
    for tid, e in zip(gen.prompt_ids_for_logprobs, raw, strict=False):
        if e is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": float(lp), "rank": r, "decoded_token": text(int(t))}
            for r, (t, lp) in enumerate(e[1], 1)
        }
        entry.setdefault(str(tid), {"logprob": float(e[0]), "decoded_token": text(tid)})
        out.append(entry)
    return out


class _Api:
    """Renders one request's deltas in the shape of its API (chat or completions)."""

    def __init__(
        self, gen: Generation, model: str, chat: bool, echo: str | None = None, prompt_logprobs: bool = False
    ) -> None:
        self.gen = gen
        self.chat = chat
        self.echo = echo  # completions with `echo`: the prompt's text, sent before each choice's answer
        self.vllm_prompt_logprobs = prompt_logprobs  # vLLM's `prompt_logprobs` field asked for
        self.head = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(gen.context.get("created") or time.time()),
            "model": model,
        }
        self.offsets = [0] * len(gen.choices)  # characters sent per choice (text_offset)
        self.started: set[int] = set()  # chat: choices whose role was sent
        self.first_index = 0  # in a batch of prompts: this prompt's index * n

    @property
    def finished(self) -> bool:
        return self.gen.finished

    @property
    def usage(self) -> Usage:
        return self.gen.usage

    async def next_choices(self, timeout: float) -> list[dict[str, Any]] | None:
        """The chunk choices of the next deltas; None when `timeout` passed first."""
        deltas = await self.gen.next(timeout=timeout)
        return None if not deltas else self.choices_of(deltas)

    def choices_of(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        return [
            self.chunk_choice(d)
            for d in deltas
            if d.text or d.finish_reason or d.logprobs or d.reasoning or d.tool_calls
        ]

    def chunk_choice(self, d: Delta) -> dict[str, Any]:
        if self.chat:
            other = d.finish_reason or d.reasoning or d.tool_calls
            delta: dict[str, Any] = {"content": d.text} if d.text or not other else {}
            if d.index not in self.started:
                self.started.add(d.index)
                delta = {"role": "assistant", "content": d.text}
            delta |= chat_extras(d.reasoning, d.tool_calls)
            out = {"index": d.index, "delta": delta, "logprobs": _chat_logprobs(d.logprobs)}
        else:
            text, lps = d.text, d.logprobs
            if d.index not in self.started:
                self.started.add(d.index)
                text, lps = self.echoed(text, lps)
            out = {
                "index": d.index,
                "text": text,
                "logprobs": _completion_logprobs(lps, self.offsets[d.index]),
            }
            if self.vllm_prompt_logprobs and d.index == 0 and self.offsets[0] == 0:
                out["prompt_logprobs"] = _vllm_prompt_logprobs(self.gen)
            self.offsets[d.index] += len(text)
            out["finish_reason"] = d.finish_reason
            out["index"] = d.index + self.first_index
            return out
        self.offsets[d.index] += len(d.text)
        out["finish_reason"] = d.finish_reason
        return out

    def echoed(self, text: str, lps: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob] | None]:
        """A choice's first text (and logprobs) with the prompt's before it, for `echo`."""
        if self.echo is None:
            return text, lps
        if lps is not None:
            lps = list(self.gen.prompt_logprobs or []) + lps
        return self.echo + text, lps


def _total(gens: list[Generation]) -> Usage:
    us = [g.usage for g in gens]
    return Usage(
        sum(u.prompt_tokens for u in us),
        sum(u.completion_tokens for u in us),
        sum(u.cached_tokens for u in us),
    )


class _Batch:
    """A list of prompts in one /v1/completions call: one request per prompt, their
    choices numbered prompt's index * n + choice, their usage summed."""

    def __init__(self, apis: list[_Api]) -> None:
        self.apis = apis
        self.head = apis[0].head
        n = len(apis[0].gen.choices)
        for i, a in enumerate(apis):
            a.head, a.first_index = self.head, i * n
        self._pending: dict[int, asyncio.Future[list[Delta]]] = {}

    @property
    def finished(self) -> bool:
        return all(a.gen.finished for a in self.apis)

    @property
    def usage(self) -> Usage:
        return _total([a.gen for a in self.apis])

    async def next_choices(self, timeout: float) -> list[dict[str, Any]] | None:
        for i, a in enumerate(self.apis):
            if i not in self._pending and not a.gen.finished:
                self._pending[i] = asyncio.ensure_future(a.gen.next(timeout=timeout))
        if not self._pending:
            return []
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        ready = [i for i in sorted(self._pending) if self._pending[i].done()]
        got = [(i, self._pending.pop(i).result()) for i in ready]  # raises GenerationError
        if not any(deltas for _, deltas in got):
            return None  # every one that answered timed out
        return [c for i, deltas in got for c in self.apis[i].choices_of(deltas)]

    async def close(self) -> None:
        """However the call ends: stop waiting, and free what still runs."""
        for f in self._pending.values():
            f.cancel()
        for f in self._pending.values():
            with contextlib.suppress(BaseException):
                await f
        self._pending.clear()
        for a in self.apis:
            await a.gen.cancel()


async def sse_frames(
    gw: Gateway, api: _Api | _Batch, include_usage: bool, after: int = 0
) -> AsyncIterator[bytes]:
    """The SSE events of a request (or a batch of them); those numbered <= `after` (a
    resume's Last-Event-ID) are computed, to rebuild the text state, but not sent."""
    n = 0
    usage_field = {"usage": None} if include_usage else {}
    one_per_delta = gw.broker.resumable
    try:
        while not api.finished:
            choices = await api.next_choices(gw.cfg.heartbeat_s)
            if choices is None:
                yield KEEPALIVE
                continue
            for group in [[c] for c in choices] if one_per_delta else [choices] if choices else []:
                n += 1
                if n > after:
                    yield frame(n, orjson.dumps(api.head | {"choices": group} | usage_field))
    except GenerationError as e:
        gw.metrics.error(e.code)
        err = APIError(500, e.code, e.message).body()
        yield frame(n + 1, orjson.dumps(err))
        yield DONE
        return
    if include_usage:
        n += 1
        if n > after:
            yield frame(n, orjson.dumps(api.head | {"choices": [], "usage": usage_json(api.usage)}))
    yield DONE


async def _collect(gen: Generation) -> list[list[Delta]]:
    per_choice: list[list[Delta]] = [[] for _ in gen.choices]
    while not gen.finished:
        for d in await gen.next():
            per_choice[d.index].append(d)
    return per_choice


async def _collect_all(gens: list[Generation]) -> list[list[list[Delta]]]:
    return list(await asyncio.gather(*(_collect(g) for g in gens)))


async def _full_response(request: Request, apis: list[_Api]) -> Response:
    """The whole answer of one request, or of a batch of prompts (one _Api each)."""
    try:
        done, collected = await until_disconnect(request.receive, _collect_all([a.gen for a in apis]))
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        for a in apis:
            await a.gen.cancel()  # no-op when it finished; frees the engine request otherwise
    if not done or collected is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = [c for api, per_choice in zip(apis, collected, strict=True) for c in _choices(api, per_choice)]
    api = apis[0]
    obj = "chat.completion" if api.chat else "text_completion"
    body = api.head | {"object": obj, "choices": choices, "usage": usage_json(_total([a.gen for a in apis]))}
    headers = apis[-1].gen.ratelimit_headers  # the last admitted: the freshest figures
    return Response(orjson.dumps(body), headers=headers, media_type="application/json")


def _choices(api: _Api, per_choice: list[list[Delta]]) -> list[dict[str, Any]]:
    gen = api.gen
    choices = []
    for i, deltas in enumerate(per_choice):
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in (d.logprobs or [])] if gen.want_logprobs else None
        finish = deltas[-1].finish_reason if deltas else None
        if api.chat:
            calls = assemble_tool_calls([c for d in deltas for c in d.tool_calls or []])
            reasoning = "".join(d.reasoning for d in deltas)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text or (None if calls else text)}
                    | chat_extras(reasoning, calls),
                    "logprobs": _chat_logprobs(lps),
                    "finish_reason": finish,
                }
            )
        else:
            text, lps = api.echoed(text, lps)
            choice = {
                "index": api.first_index + i,
                "text": text,
                "logprobs": _completion_logprobs(lps, 0),
                "finish_reason": finish,
            }
            if api.vllm_prompt_logprobs:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(gen)
            choices.append(choice)
    return choices


async def _generate(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    raw = await read_body(request, gw.cfg.max_body_bytes)
    model = ChatRequest if chat else CompletionRequest
    if len(raw) <= _VALIDATE_INLINE_BYTES:
        req = validate_http(model, raw, gw.cfg)
    else:  # a large body must not hold up the other streams
        req = await asyncio.to_thread(validate_http, model, raw, gw.cfg)
    tenant = request_tenant(request.state)
    batch = req.prompts if isinstance(req, CompletionRequest) else None
    if batch is not None:
        return await _generate_batch(request, gw, req, batch, tenant)
    gen = await gw.start(req, "chat" if chat else "completions", tenant)
    api = (
        _completion_api(gw, gen, req)
        if isinstance(req, CompletionRequest)
        else _Api(gen, _model(gw, gen), chat)
    )
    if req.stream:
        headers = {RESUME_TOKEN_HEADER: gen.resume_token or ""} | gen.ratelimit_headers
        return _event_stream(gw, sse_frames(gw, api, req.include_usage), _leave(gen), headers)
    return await _full_response(request, [api])


def _model(gw: Gateway, gen: Generation) -> str:
    return str(gen.context.get("model") or gw.model_name)


def _completion_api(gw: Gateway, gen: Generation, req: CompletionRequest) -> _Api:
    echo = prompt_text(gen, req) if req.echo else None
    return _Api(gen, _model(gw, gen), False, echo, req.prompt_logprobs is not None)


async def _generate_batch(
    request: Request, gw: Gateway, req: CompletionRequest, prompts: list[str | list[int]], tenant: Tenant
) -> Response:
    """A list of prompts: each is a request of its own (admitted, queued and rate
    limited as one); the answer is one response. Not resumable: a cut stream ends
    them all."""
    gens: list[Generation] = []
    try:
        for i, p in enumerate(prompts):
            try:
                gens.append(await gw.start(req.one(p), "completions", tenant))
            except APIError as e:
                if e.param == "prompt":  # name the prompt of the batch
                    e.param, e.message = f"prompt.{i}", e.message.replace("prompt", f"prompt.{i}", 1)
                raise
    except BaseException:
        for g in gens:
            await g.cancel()
        raise
    batch = _Batch([_completion_api(gw, g, req.one(p)) for g, p in zip(gens, prompts, strict=True)])
    if not req.stream:
        return await _full_response(request, batch.apis)
    return _event_stream(
        gw, sse_frames(gw, batch, req.include_usage), batch.close, gens[-1].ratelimit_headers
    )


def prompt_text(gen: Generation, req: CompletionRequest) -> str:
    """The prompt as the client gave it: its text, or its token ids decoded."""
    prompt = req.single
    if isinstance(prompt, str):
        return prompt
    return str(gen.svc.codec.backend.decode(prompt, skip_special_tokens=False))


def _event_stream(
    gw: Gateway,
    frames: AsyncIterator[bytes],
    on_close: Callable[[], Awaitable[None]],
    headers: dict[str, str] | None = None,
) -> EventStream:
    """An SSE response; `on_close` runs however it ends (finished, the client left, or
    took no data for --send-timeout-s): it detaches or cancels what still runs."""
    return EventStream(
        frames,
        on_close=on_close,
        send_timeout_s=gw.cfg.send_timeout_s,
        on_timeout=lambda: gw.metrics.send_timeout("sse"),
        headers=headers,
    )


def _leave(gen: Generation) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        await gen.leave()  # nothing when it finished

    return close


async def resume_stream(request: Request) -> Response:
    """`GET /v1/streams/{request_id}` with `X-Resume-Token` (or `?resume_token=`) and
    `Last-Event-ID` (or `?last_event_id=`): the rest of a streamed completion, from
    this or any other gateway of the deployment, for the client that holds its token."""
    gw: Gateway = request.app.state.gateway
    rid = request.path_params["request_id"]
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    if not _EVENT_ID.fullmatch(raw):  # checked before anything starts (ASCII digits only)
        raise APIError(
            400, "invalid_request", "Last-Event-ID must be a non-negative integer", "Last-Event-ID"
        )
    token = request.headers.get(RESUME_TOKEN_HEADER) or request.query_params.get("resume_token")
    if not token:
        raise APIError(
            400,
            "invalid_request",
            "resuming a stream needs its resume token (the X-Resume-Token header of its first answer)",
            "resume_token",
        )
    gen = await gw.resume(token, request_id=rid)
    if gen is None:
        raise APIError(
            404,
            "unknown_id",
            f"no stream {rid!r} to resume with this token (unknown, past its retention, or not yours)",
            "id",
        )
    api = _Api(gen, _model(gw, gen), chat="chat" in gen.api)
    frames = sse_frames(gw, api, bool(gen.context.get("include_usage")), after=int(raw))
    return _event_stream(gw, frames, _leave(gen))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def models(request: Request) -> Response:
    """Every model a live engine serves (and the key may use), the default first,
    each with the context length its engines allow. An alias is listed as a model of
    its own (`parent`: the model it names), as vLLM lists served names."""
    gw: Gateway = request.app.state.gateway
    tenant = request_tenant(request.state)
    data: list[dict[str, object]] = []
    for name, engines in (await gw.live_models()).items():
        if not tenant.may_use(name):
            continue
        card: dict[str, object] = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "wsllm",
            "max_model_len": min(e.max_model_len for e in engines),
        }
        data.append(card)
        aliases = sorted({a for e in engines for a in e.aliases} - {name})
        data += [card | {"id": a, "parent": name} for a in aliases]
    return JSONResponse({"object": "list", "data": data})
