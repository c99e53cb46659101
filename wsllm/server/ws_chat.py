"""The WebSocket's own messages for a chat or completion request (docs/protocol.md):
each delta's `reasoning` and `delta` (text, tool calls, logprobs), numbered by `seq`
(the same on a resume, on any gateway), a `done` per choice (the last with the usage),
and, while the request waits for an engine, `queued` with its place when it changes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from wsllm.server.delta import Delta
from wsllm.server.generation import Generation

log = logging.getLogger(__name__)


async def chat_messages(msg_id: str, gen: Generation, after_seq: int = -1) -> AsyncIterator[dict[str, Any]]:
    """A request's messages until its last choice is done; those numbered up to
    `after_seq` (a resume's) are not sent. Raises GenerationError when it fails."""
    seq = 0
    open_choices = len(gen.choices)
    told: int | None = None  # the place last sent in `queued`
    while open_choices:
        deltas = await gen.next(timeout=gen.queue_poll_s())
        if not deltas:
            place = await _place(gen)
            if place and place != told:
                told = place
                yield {"type": "queued", "id": msg_id, "position": place}
            continue
        for d in deltas:
            for msg in _messages(msg_id, d):
                if seq > after_seq:
                    yield msg | {"seq": seq}
                seq += 1
            if d.finish_reason is not None:
                open_choices -= 1
                yield _done(msg_id, gen, d, last=open_choices == 0)


async def _place(gen: Generation) -> int | None:
    """Its place in the queue while it waits (a courtesy: never fails the request)."""
    if gen.started or gen.finished:
        return None
    try:
        return await gen.position()
    except Exception:
        log.debug("no queue position for %s", gen.request_id, exc_info=True)
        return None


def _messages(msg_id: str, d: Delta) -> list[dict[str, Any]]:
    """A delta's messages (their `seq` still to set): its reasoning, then its text and
    tool calls."""
    out = [{"type": "reasoning", "id": msg_id, "index": d.index, "text": d.reasoning}] if d.reasoning else []
    if d.text or d.tool_calls:
        out.append(_delta(msg_id, d))
    return out


def _delta(msg_id: str, d: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "delta", "id": msg_id, "index": d.index, "text": d.text}
    if d.tool_calls:
        out["tool_calls"] = d.tool_calls
    if d.logprobs is not None:
        out["logprobs"] = [
            {
                "token": t.token,
                "logprob": t.logprob,
                "top_logprobs": [{"token": x, "logprob": y} for x, y in t.top],
            }
            for t in d.logprobs
        ]
    return out


def _done(msg_id: str, gen: Generation, d: Delta, last: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "done",
        "id": msg_id,
        "index": d.index,
        "finish_reason": d.finish_reason,
        "request_id": gen.request_id,
    }
    if last:
        u = gen.usage
        out["usage"] = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "cached_tokens": u.cached_tokens,
        }
        if u.drafted_tokens:  # speculative decoding's drafts, as the HTTP usage names them
            out["usage"] |= {"accepted_prediction_tokens": u.accepted_tokens,
                             "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens}  # fmt: skip
    return out
