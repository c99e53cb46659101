"""Anthropic's Messages API: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, for Anthropic's clients (its SDK, coding agents).

A Messages request is translated into a chat request (messages_request.py) and goes
through the same path as a chat completion: preparation, admission, the engine, and
one Generation whose deltas (reasoning, content, tool calls) are rendered here as
Anthropic's content blocks: `thinking` (the `<think>` splitter's reasoning), `text` and
`tool_use`. Errors on these routes are in Anthropic's shape (errors.anthropic_body).
A streamed answer is not resumable: when its client leaves, the request is cancelled."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.broker.base import BrokerError
from wsllm.server.chat.output import FINISH_TOOL_CALLS, assemble_tool_calls
from wsllm.server.errors import APIError, anthropic_body, anthropic_response, from_broker, from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Delta, Generation, GenerationError
from wsllm.server.messages_request import CountTokensRequest, MessagesRequest, validate
from wsllm.server.middleware import request_tenant
from wsllm.server.openai_api import read_body
from wsllm.server.prepare import prepare
from wsllm.server.resume import Api
from wsllm.server.sse import EventStream, until_disconnect
from wsllm.types import FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)

# The engine's finish reasons as Anthropic's stop reasons (a stop string: "stop_sequence").
_STOP_REASONS = {FINISH_STOP: "end_turn", FINISH_LENGTH: "max_tokens", FINISH_TOOL_CALLS: "tool_use"}


def _anthropic_errors(
    route: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Answer a route's failures in Anthropic's error shape (the app's handlers give
    OpenAI's)."""

    async def handled(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            return await route(request)
        except BrokerError as e:
            err = from_broker(e)
        except APIError as e:
            err = e
        except Exception:
            log.exception("unhandled error on %s", request.url.path)
            err = APIError(500, "internal_error", "internal error; see the server log")
        gw.metrics.error(err.code)
        return anthropic_response(err)

    return handled


@_anthropic_errors
async def messages(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    raw = await read_body(request, gw.cfg.max_body_bytes)
    req = await validate(raw, gw.cfg, MessagesRequest)
    gen = await gw.start(req, Api.MESSAGES, request_tenant(request.state))
    model = gen.context.model or gw.model_name
    if req.stream:
        return EventStream(
            _events(gw, gen, model),
            on_close=gen.cancel,  # nothing can resume it: free the engine request
            send_timeout_s=gw.cfg.send_timeout_s,
            on_timeout=lambda: gw.metrics.send_timeout("sse"),
            headers=gen.ratelimit_headers,
        )
    try:
        done, deltas = await until_disconnect(request.receive, _collect(gen))
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        await gen.cancel()  # no-op when it finished
    if not done or deltas is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    body = _head(gen, model) | {"content": _content(deltas)} | _stop(gen, deltas[-1].finish_reason)
    body["usage"] = _usage(gen)
    return Response(orjson.dumps(body), headers=gen.ratelimit_headers, media_type="application/json")


@_anthropic_errors
async def count_tokens(request: Request) -> Response:
    """`{"input_tokens": N}`: the prompt tokens a Messages request with these fields
    would report (the same preparation: template, tools, system)."""
    gw: Gateway = request.app.state.gateway
    req = await validate(await read_body(request, gw.cfg.max_body_bytes), gw.cfg, CountTokensRequest)
    model, max_len = await gw.models.resolve(req.model, request_tenant(request.state))
    prep = await prepare(req, Api.MESSAGES, model, max_len, gw.cfg)
    return JSONResponse({"input_tokens": len(prep.prompt_ids)})


async def _collect(gen: Generation) -> list[Delta]:
    out: list[Delta] = []
    while not gen.finished:
        out += await gen.next()
    return out or [Delta(0, "", FINISH_STOP)]


def _head(gen: Generation, model: str) -> dict[str, Any]:
    return {"id": gen.request_id, "type": "message", "role": "assistant", "model": model}


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop(gen: Generation, finish: str | None) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence`: which stop string ended the answer, if one did."""
    stop = gen.choices[0].stop
    matched = stop.matched if stop is not None else None
    if finish == FINISH_STOP and matched is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": _STOP_REASONS.get(finish or FINISH_STOP, "end_turn"), "stop_sequence": None}


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON object text, as the parsers give them) as `input`."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        log.warning("a tool call's arguments are not a JSON object: %.80r", arguments)
        return {}
    return value


def _content(deltas: list[Delta]) -> list[dict[str, Any]]:
    """The whole answer's content blocks: its thinking, its text, its calls."""
    blocks: list[dict[str, Any]] = []
    thinking = "".join(d.reasoning for d in deltas)
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text = "".join(d.text for d in deltas)
    if text:
        blocks.append({"type": "text", "text": text})
    for call in assemble_tool_calls([c for d in deltas for c in d.tool_calls or []]):
        fn = call["function"]
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _tool_input(fn["arguments"])}
        )
    return blocks


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind} | data))


class BlockStream:
    """Deltas in, Anthropic's content block events out: a block opens when the kind of
    output changes (thinking, text, a new tool call) and closes when the next opens or
    the answer ends."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def feed(self, d: Delta) -> list[bytes]:
        out: list[bytes] = []
        if d.reasoning:
            out += self._open("thinking", {"thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.text:
            out += self._open("text", {"text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.text}))
        for call in d.tool_calls or []:
            fn = call.get("function") or {}
            if "id" in call:  # a call's first delta: its own block
                out += self._open("tool_use", {"id": call["id"], "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, kind: str, fields: dict[str, Any]) -> list[bytes]:
        if self.kind == kind and kind != "tool_use":
            return []
        out = self.close()
        self.index += 1
        self.kind = kind
        block = {"type": kind} | fields
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


async def _events(gw: Gateway, gen: Generation, model: str) -> AsyncIterator[bytes]:
    """The SSE events of a streamed message: message_start, ping, the content blocks,
    message_delta (stop reason, usage), message_stop; `ping` while the model is quiet;
    an `error` event when the request fails midway."""
    start = _head(gen, model) | {"content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = _usage(gen)
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    blocks = BlockStream()
    finish: str | None = None
    try:
        while not gen.finished:
            deltas = await gen.next(timeout=gw.cfg.heartbeat_s)
            if not deltas and not gen.finished:
                yield _event("ping", {})
            for d in deltas:
                for event in blocks.feed(d):
                    yield event
                finish = d.finish_reason or finish
    except GenerationError as e:
        gw.metrics.error(e.code)
        yield b"event: error\ndata: %s\n\n" % orjson.dumps(anthropic_body(from_generation(e.code, e.message)))
        return
    for event in blocks.close():
        yield event
    usage = _usage(gen)
    yield _event("message_delta", {"delta": _stop(gen, finish), "usage": usage})
    yield _event("message_stop", {})
