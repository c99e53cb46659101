"""Anthropic's Messages shapes of one answer, rendered straight from the chat path's
deltas (reasoning, content, tool calls): content blocks `thinking` (the `<think>`
splitter's reasoning), `text` and `tool_use`, whole (`content`, `stop`, `usage`) or as
its SSE events (`events`: a block opens when the kind of output changes and closes when
the next opens or the answer ends)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from wsllm.server.chat.output import FINISH_TOOL_CALLS, assemble_tool_calls
from wsllm.server.delta import Delta
from wsllm.server.errors import anthropic_body, from_generation
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.metrics import Metrics
from wsllm.types import FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)

# The engine's finish reasons as Anthropic's stop reasons (a stop string: "stop_sequence").
_STOP_REASONS = {FINISH_STOP: "end_turn", FINISH_LENGTH: "max_tokens", FINISH_TOOL_CALLS: "tool_use"}


async def collect(gen: Generation) -> list[Delta]:
    out: list[Delta] = []
    while not gen.finished:
        out += await gen.next()
    return out or [Delta(0, "", FINISH_STOP)]


def head(gen: Generation, model: str) -> dict[str, Any]:
    return {"id": gen.request_id, "type": "message", "role": "assistant", "model": model}


def usage(gen: Generation) -> dict[str, Any]:
    """Anthropic's usage: its input fields are disjoint (clients and cost trackers add
    them), so `input_tokens` is the prompt less what the prefix cache served. The engine
    tells the cached count with a choice's end: `message_start` has none of it yet."""
    u = gen.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop(gen: Generation, finish: str | None) -> dict[str, Any]:
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


def content(deltas: list[Delta]) -> list[dict[str, Any]]:
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


async def events(gen: Generation, model: str, heartbeat_s: float, metrics: Metrics) -> AsyncIterator[bytes]:
    """The SSE events of a streamed message: message_start, ping, the content blocks,
    message_delta (stop reason, usage), message_stop; `ping` while the model is quiet;
    an `error` event when the request fails midway."""
    start = head(gen, model) | {"content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = usage(gen)
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    blocks = BlockStream()
    finish: str | None = None
    try:
        while not gen.finished:
            deltas = await gen.next(timeout=heartbeat_s)
            if not deltas and not gen.finished:
                yield _event("ping", {})
            for d in deltas:
                for event in blocks.feed(d):
                    yield event
                finish = d.finish_reason or finish
    except GenerationError as e:
        metrics.error(e.code)
        yield b"event: error\ndata: %s\n\n" % orjson.dumps(anthropic_body(from_generation(e.code, e.message)))
        return
    for event in blocks.close():
        yield event
    yield _event("message_delta", {"delta": stop(gen, finish), "usage": usage(gen)})
    yield _event("message_stop", {})


async def whole(gen: Generation, model: str) -> bytes:
    """The whole message, once the request ended. Raises GenerationError."""
    deltas = await collect(gen)
    body = head(gen, model) | {"content": content(deltas)} | stop(gen, deltas[-1].finish_reason)
    return orjson.dumps(body | {"usage": usage(gen)})
