"""The WebSocket's `chat`, `completion` and `resume` kinds (wing.WsKind): a chat or completion
request admitted, prepared and submitted as its HTTP route's are, and its messages
(docs/protocol.md): `started` with its resume token, each delta's `reasoning` and `delta`
(text, tool calls, logprobs), numbered by `seq` (the same on a resume, on any gateway), a
`done` per choice (the last with the usage), and, while the request waits for an engine,
`queued` with its place when it changes. A `resume` replays a request cut by a disconnect
(on any gateway, with its resume token) and sends the messages after `after_seq`. The
session adds each message's `id`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from wsllm.config_gateway import GatewayConfig
from wsllm.server.admission import Admission
from wsllm.server.delta import Delta
from wsllm.server.errors import APIError
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation
from wsllm.server.quota import Charge, coarse_charge
from wsllm.server.resume import Api
from wsllm.server.schemas import WsChat, WsCompletion, WsResume, validate_ws_request, validated
from wsllm.server.tenants import Tenant
from wsllm.server.wing import WsKind, WsRun

log = logging.getLogger(__name__)


def kinds(gw: Gateway) -> dict[str, WsKind[Any]]:
    """The wing's WebSocket kinds, by message type."""

    def charge(req: WsChat | WsCompletion, cfg: GatewayConfig) -> Charge:
        return Charge(req.model, [coarse_charge(req, cfg.default_max_tokens)], req.priority)

    async def run(adm: Admission, req: WsChat | WsCompletion) -> WsRun:
        gen = await adm.start(0, req)
        started = {"request_id": gen.request_id, "resume_token": gen.resume_token}
        return WsRun(started, chat_messages(gen), gen.cancel, gen.leave)

    async def resume(tenant: Tenant, req: WsResume) -> WsRun:
        gen = await gw.resume(req.resume_token, tenant=tenant)
        if gen is None:
            raise APIError(
                400,
                "unknown_id",
                "no request to resume with this token (it ended with its socket, expired, or is not yours)",
                "resume_token",
            )
        return WsRun(None, chat_messages(gen, req.after_seq), gen.cancel, gen.leave)

    chat: WsKind[WsChat | WsCompletion] = WsKind(
        Api.WS_CHAT, lambda f, cfg: validate_ws_request(WsChat, f, cfg), charge, run
    )
    completion: WsKind[WsChat | WsCompletion] = WsKind(
        Api.WS_COMPLETION, lambda f, cfg: validate_ws_request(WsCompletion, f, cfg), charge, run
    )
    resumed: WsKind[WsResume] = WsKind(Api.WS_CHAT, lambda f, cfg: validated(WsResume, f), resume=resume)
    return {"chat": chat, "completion": completion, "resume": resumed}


async def chat_messages(gen: Generation, after_seq: int = -1) -> AsyncIterator[dict[str, Any]]:
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
                yield {"type": "queued", "position": place}
            continue
        for d in deltas:
            for msg in _messages(d):
                if seq > after_seq:
                    yield msg | {"seq": seq}
                seq += 1
            if d.finish_reason is not None:
                open_choices -= 1
                yield _done(gen, d, last=open_choices == 0)


async def _place(gen: Generation) -> int | None:
    """Its place in the queue while it waits (a courtesy: never fails the request)."""
    if gen.started or gen.finished:
        return None
    try:
        return await gen.position()
    except Exception:
        log.debug("no queue position for %s", gen.request_id, exc_info=True)
        return None


def _messages(d: Delta) -> list[dict[str, Any]]:
    """A delta's messages (their `seq` still to set): its reasoning, then its text and
    tool calls."""
    out = [{"type": "reasoning", "index": d.index, "text": d.reasoning}] if d.reasoning else []
    if d.text or d.tool_calls:
        out.append(_delta(d))
    return out


def _delta(d: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "delta", "index": d.index, "text": d.text}
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


def _done(gen: Generation, d: Delta, last: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "done",
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
