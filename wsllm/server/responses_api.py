"""OpenAI's Responses API: `POST /v1/responses` (streamed, whole, or in the
background), `GET` and `DELETE /v1/responses/{id}`, `GET .../input_items` and
`POST .../cancel`.

A Responses request is translated into the chat request every other route prepares
(responses_schema.to_chat) and goes through the same path (prepare, admit, submit);
its answer is rendered by responses_render. A response with `store` (the default) is
kept by the broker's response store for --response-ttl-s, readable only with a key of
the tenant that made it (another key gets 404, as for an unknown id): the response
itself, and its conversation (input and output, in the kept shape) for a next turn's
`previous_response_id`. It is stored before its last event is sent, so a client can
continue the moment it has read `response.completed`.

Cancellation: a streamed or whole answer runs while its client waits for it; closing
the stream (or the connection) cancels it and frees its engine request, as on the chat
route. A `background` answer runs on the gateway that took it, stored `in_progress`
at once and again when it ends; `cancel` stops it there, or through the broker from
another gateway. A response is not resumable (no `starting_after`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.broker.base import BrokerError
from wsllm.server import textwork
from wsllm.server.errors import APIError, from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.middleware import request_tenant
from wsllm.server.openai_api import read_body
from wsllm.server.responses_render import Event, ResponseBuilder, input_item, output_turns, settings
from wsllm.server.responses_schema import (
    ResponsesRequest,
    Turn,
    renamed,
    stored_turns,
    to_chat,
    turns,
    validate_responses,
)
from wsllm.server.resume import Api
from wsllm.server.sse import KEEPALIVE, EventStream, until_disconnect
from wsllm.server.tenants import Tenant

log = logging.getLogger(__name__)

# Bodies larger than this are validated off the event loop (as on the chat route).
_VALIDATE_INLINE_BYTES = 64 * 1024
# How long a cancel waits for the cancelled response's end to be stored.
_CANCEL_WAIT_S = 5.0


def _sse(ev: Event) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (ev["type"].encode(), orjson.dumps(ev))


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        "response_not_found" if param == "response_id" else "previous_response_not_found",
        f"{param}: no response {response_id!r} (unknown, expired, not stored, or another key's)",
        param,
    )


class _Keeper:
    """Stores a finished response with its conversation, when the request asked."""

    def __init__(self, gw: Gateway, tenant: Tenant, conversation: list[Turn], store: bool) -> None:
        self.gw, self.tenant, self.conversation, self.store = gw, tenant, conversation, store

    async def keep(self, b: ResponseBuilder) -> None:
        if not self.store:
            return
        record = {
            "response": b.response,
            "conversation": self.conversation + output_turns(b.output),
            "inputs": len(self.conversation),  # the turns before this response's output
        }
        try:
            await self.gw.responses.put(
                b.id, self.tenant.name, orjson.dumps(record), self.gw.cfg.response_ttl_s
            )
        except BrokerError:  # the answer is still the client's; only a next turn will miss it
            log.exception("response %s could not be stored", b.id)


class ResponseRun:
    """One response on its way: its engine request, its event machine, its keeper."""

    def __init__(self, gen: Generation, builder: ResponseBuilder, keeper: _Keeper) -> None:
        self.gen, self.builder, self.keeper = gen, builder, keeper

    async def batches(self, heartbeat_s: float | None) -> AsyncIterator[list[Event]]:
        """The response's events in batches as its answer comes ([] when `heartbeat_s`
        passed with nothing new). The last batch holds the closing events, sent once
        the response is stored; a failure mid-way ends it with `response.failed`."""
        b, held = self.builder, []
        try:
            async for batch in self.steps(heartbeat_s):
                if b.response["status"] == "in_progress":
                    yield batch
                else:
                    held = batch
        except GenerationError as e:
            self.keeper.gw.metrics.error(e.code)
            held = b.fail(e.code, e.message)
        await self.keeper.keep(b)
        yield held

    async def steps(self, heartbeat_s: float | None) -> AsyncIterator[list[Event]]:
        """The events of each step of the answer, the closing ones last. Raises
        GenerationError."""
        gen, b = self.gen, self.builder
        yield b.start()
        reason = None
        while not gen.finished:
            events: list[Event] = []
            for d in await gen.next(timeout=heartbeat_s):
                if d.index == 0:  # a response has one choice
                    events += b.feed(d)
                    reason = d.finish_reason or reason
            yield events
        yield b.finish(reason, gen.usage)

    async def whole(self) -> dict[str, Any]:
        """The whole response (stored when asked). Raises GenerationError."""
        async for _ in self.steps(None):
            pass
        await self.keeper.keep(self.builder)
        return self.builder.response


async def start_response(gw: Gateway, req: ResponsesRequest, tenant: Tenant) -> ResponseRun:
    """Translate, prepare, admit and submit a checked Responses request of `tenant`."""
    history = await _history(gw, req.previous_response_id, tenant)
    conversation = history + turns(req)
    chat = to_chat(req, conversation, len(history), gw.cfg)
    try:
        gen = await gw.start(chat, Api.RESPONSES, tenant)
    except APIError as e:
        raise renamed(e) from None
    response_id = "resp_" + gen.request_id.partition("-")[2]
    echo = settings(req, gen.context.model or gw.model_name)
    keeper = _Keeper(gw, tenant, conversation, req.store)
    return ResponseRun(gen, ResponseBuilder(response_id, echo, gen.context.created), keeper)


async def create_response(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    raw = await read_body(request, gw.cfg.max_body_bytes)
    if len(raw) <= _VALIDATE_INLINE_BYTES:
        req = validate_responses(raw, gw.cfg)
    else:  # a large body must not hold up the other streams
        req = await textwork.run(validate_responses, raw, gw.cfg)
    run = await start_response(gw, req, request_tenant(request.state))
    gen = run.gen
    if req.background:
        return await _background(gw, run)
    if req.stream:
        return EventStream(
            _frames(run.batches(gw.cfg.heartbeat_s)),
            on_close=gen.cancel,  # not resumable: a closed stream ends the response
            send_timeout_s=gw.cfg.send_timeout_s,
            on_timeout=lambda: gw.metrics.send_timeout("sse"),
            headers=gen.ratelimit_headers,
        )
    try:
        done, body = await until_disconnect(request.receive, run.whole())
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        await gen.cancel()  # no-op when it finished; frees the engine request otherwise
    if not done:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return Response(orjson.dumps(body), headers=gen.ratelimit_headers, media_type="application/json")


async def _background(gw: Gateway, run: ResponseRun) -> Response:
    """Answer at once with the response in progress (stored), and run it here until it
    ends or is cancelled; each end is stored for `GET`."""
    rid = run.builder.id
    await run.keeper.keep(run.builder)

    async def finish() -> None:
        try:
            await run.whole()
        except GenerationError as e:
            gw.metrics.error(e.code)
            run.builder.fail(e.code, e.message)
            await run.keeper.keep(run.builder)
        finally:
            gw.background.pop(rid, None)
            await run.gen.cancel()  # no-op when it finished; releases the tenant's limits

    gw.background[rid] = (run.gen, asyncio.get_running_loop().create_task(finish()))
    headers = run.gen.ratelimit_headers
    return Response(orjson.dumps(run.builder.response), headers=headers, media_type="application/json")


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: stop a background response of this key's
    tenant and answer it as stored (`cancelled`; unchanged when it had ended). It runs
    on this gateway (cancelled here) or on another of the deployment (aborted through
    the broker; that gateway stores the end)."""
    gw: Gateway = request.app.state.gateway
    rid = request.path_params["response_id"]
    record = await _stored(request)
    if not record["response"].get("background"):
        raise APIError(400, "invalid_request", "only a background response can be cancelled", "response_id")
    local = gw.background.get(rid)
    if local is not None:
        gen, task = local
        await gen.cancel()
        await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
    elif record["response"]["status"] == "in_progress":
        await gw.broker.abort("resp-" + rid.removeprefix("resp_"))  # the engine request's id
        deadline = asyncio.get_running_loop().time() + _CANCEL_WAIT_S
        while record["response"]["status"] == "in_progress" and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            record = await _stored(request)
    else:
        return Response(orjson.dumps(record["response"]), media_type="application/json")
    return Response(orjson.dumps((await _stored(request))["response"]), media_type="application/json")


async def _history(gw: Gateway, previous: str | None, tenant: Tenant) -> list[Turn]:
    """The conversation a `previous_response_id` continues; 404 when the key cannot see it."""
    if previous is None:
        return []
    raw = await gw.responses.get(previous, tenant.name)
    if raw is None:
        raise _not_found(previous, "previous_response_id")
    return stored_turns(orjson.loads(raw)["conversation"])


async def _frames(batches: AsyncIterator[list[Event]]) -> AsyncIterator[bytes]:
    async for batch in batches:
        if not batch:
            yield KEEPALIVE
        for ev in batch:
            yield _sse(ev)


async def get_response(request: Request) -> Response:
    """A stored response, for a key of the tenant that made it."""
    if request.query_params.get("stream", "false").lower() == "true":
        raise APIError(
            400, "invalid_request", "stream: only background responses stream again; none run here", "stream"
        )
    return Response(orjson.dumps((await _stored(request))["response"]), media_type="application/json")


async def _stored(request: Request) -> dict[str, Any]:
    """The stored record that the path's `response_id` names, for this key; else 404."""
    gw: Gateway = request.app.state.gateway
    rid = request.path_params["response_id"]
    raw = await gw.responses.get(rid, request_tenant(request.state).name)
    if raw is None:
        raise _not_found(rid, "response_id")
    record: dict[str, Any] = orjson.loads(raw)
    return record


async def list_input_items(request: Request) -> Response:
    """`GET /v1/responses/{id}/input_items`: the conversation the response answered
    (the turns of the responses it continued, then its own input), with `order`
    (`desc` by default), `limit` (1 to 100, 20) and `after` (an item id), as OpenAI's."""
    record = await _stored(request)
    q = request.query_params
    order, limit = q.get("order", "desc"), q.get("limit", "20")
    if order not in ("asc", "desc"):
        raise APIError(400, "invalid_request", "order: asc or desc", "order")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(400, "invalid_request", "limit: an integer from 1 to 100", "limit")
    hexid = request.path_params["response_id"].removeprefix("resp_")
    turns_ = record["conversation"][: record["inputs"]]
    items = [input_item(t, f"item_{hexid}{i:04d}") for i, t in enumerate(turns_)]
    if order == "desc":
        items.reverse()
    after = q.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(
                400, "invalid_request", f"after: no item {after!r} in this response's input", "after"
            )
        items = items[at + 1 :]
    page = items[: int(limit)]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    body = {
        "object": "list",
        "data": page,
        "first_id": first,
        "last_id": last,
        "has_more": len(items) > len(page),
    }
    return Response(orjson.dumps(body), media_type="application/json")


async def delete_response(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    rid = request.path_params["response_id"]
    if not await gw.responses.delete(rid, request_tenant(request.state).name):
        raise _not_found(rid, "response_id")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})
