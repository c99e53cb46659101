"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, and
`GET /v1/streams/{id}` to resume a cut SSE stream (resumable brokers).

A resumable stream must number its events the same way on every gateway, so with
such a broker each delta is its own event (the `id:` of an event is a pure function
of the request's engine events); otherwise a slow reader gets fewer, larger chunks.
A streamed answer carries its resume token in the `X-Resume-Token` header: reading
the stream again needs it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.server import textwork
from wsllm.server.errors import APIError, from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Delta, Generation, GenerationError
from wsllm.server.middleware import request_tenant
from wsllm.server.openai_render import AnswerView, BatchView, prompt_text, usage_json, whole_answer
from wsllm.server.resume import Api
from wsllm.server.schemas import ChatRequest, CompletionRequest, validate_http
from wsllm.server.sse import DONE, KEEPALIVE, EventStream, frame, until_disconnect
from wsllm.server.tenants import Tenant

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


async def sse_frames(
    gw: Gateway, api: AnswerView | BatchView, include_usage: bool, after: int = 0
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


async def _full_response(request: Request, apis: list[AnswerView]) -> Response:
    """The whole answer of one request, or of a batch of prompts (one view each)."""
    try:
        done, collected = await until_disconnect(request.receive, _collect_all([a.gen for a in apis]))
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        for a in apis:
            await a.gen.cancel()  # no-op when it finished; frees the engine request otherwise
    if not done or collected is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    headers = apis[-1].gen.ratelimit_headers  # the last admitted: the freshest figures
    if any(a.gen.prompt_logprobs_raw is not None for a in apis):  # megabytes: off the loop
        raw = await textwork.run(lambda: orjson.dumps(whole_answer(apis, collected)))
    else:
        raw = orjson.dumps(whole_answer(apis, collected))
    return Response(raw, headers=headers, media_type="application/json")


async def _generate(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    raw = await read_body(request, gw.cfg.max_body_bytes)
    model = ChatRequest if chat else CompletionRequest
    if len(raw) <= _VALIDATE_INLINE_BYTES:
        req = validate_http(model, raw, gw.cfg)
    else:  # a large body must not hold up the other streams
        req = await textwork.run(validate_http, model, raw, gw.cfg)
    tenant = request_tenant(request.state)
    batch = req.prompts if isinstance(req, CompletionRequest) else None
    if batch is not None:
        return await _generate_batch(request, gw, req, batch, tenant)
    gen = await gw.start(req, Api.CHAT if chat else Api.COMPLETIONS, tenant)
    api = (
        _completion_api(gw, gen, req)
        if isinstance(req, CompletionRequest)
        else AnswerView(gen, _model(gw, gen), chat)
    )
    if req.stream:
        headers = {RESUME_TOKEN_HEADER: gen.resume_token or ""} | gen.ratelimit_headers
        return _event_stream(gw, sse_frames(gw, api, req.include_usage), gen.leave, headers)
    return await _full_response(request, [api])


def _model(gw: Gateway, gen: Generation) -> str:
    return gen.context.model or gw.model_name


def _completion_api(gw: Gateway, gen: Generation, req: CompletionRequest) -> AnswerView:
    echo = prompt_text(gen, req) if req.echo else None
    return AnswerView(gen, _model(gw, gen), False, echo, req.prompt_logprobs is not None)


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
                gens.append(await gw.start(req.one(p), Api.COMPLETIONS, tenant))
            except APIError as e:
                if e.param == "prompt":  # name the prompt of the batch
                    e.param, e.message = f"prompt.{i}", e.message.replace("prompt", f"prompt.{i}", 1)
                raise
    except BaseException:
        for g in gens:
            await g.cancel()
        raise
    batch = BatchView([_completion_api(gw, g, req.one(p)) for g, p in zip(gens, prompts, strict=True)])
    if not req.stream:
        return await _full_response(request, batch.apis)
    return _event_stream(
        gw, sse_frames(gw, batch, req.include_usage), batch.close, gens[-1].ratelimit_headers
    )


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
    gen = await gw.resume(token, request_id=rid, tenant=request_tenant(request.state))
    if gen is None:
        raise APIError(
            404,
            "unknown_id",
            f"no stream {rid!r} to resume with this token (unknown, past its retention, or not yours)",
            "id",
        )
    api = AnswerView(gen, _model(gw, gen), chat=gen.context.api.is_chat)
    frames = sse_frames(gw, api, gen.context.include_usage, after=int(raw))
    return _event_stream(gw, frames, gen.leave, gen.ratelimit_headers)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def models(request: Request) -> Response:
    """Every model a live engine serves (and the key may use): `ServedModels.cards`."""
    gw: Gateway = request.app.state.gateway
    data = await gw.models.cards(request_tenant(request.state))
    return JSONResponse({"object": "list", "data": data})
