"""Anthropic's Messages API: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, for Anthropic's clients (its SDK, coding agents).

A Messages request is translated, as it is validated, into a chat request
(translate.py) and goes the chat path: admission, preparation, the engine, and one
Generation whose deltas render.py shapes as Anthropic's content blocks. Errors on these
routes are in Anthropic's shape (errors.anthropic_body). A streamed answer is not
resumable: when its client leaves, the request is cancelled. `count_tokens` is admitted
like every call (its prompt's coarse charge), templates and tokenizes, and settles at
the prompt's tokens."""

from __future__ import annotations

from starlette.routing import Route

from wsllm.config_gateway import GatewayConfig
from wsllm.server import prepare
from wsllm.server.admission import Admission
from wsllm.server.api.messages import render
from wsllm.server.api.messages.request import CountTokensRequest, MessagesRequest, parsed
from wsllm.server.api.messages.translate import to_chat
from wsllm.server.errors import anthropic_response
from wsllm.server.gateway import Gateway
from wsllm.server.http import Answer, Endpoint, route
from wsllm.server.quota import Charge, chat_prompt_tokens, coarse_charge, prompt_charge
from wsllm.server.resume import Api
from wsllm.server.schemas import ChatRequest
from wsllm.server.wing import Wing


def _messages(raw: bytes, cfg: GatewayConfig) -> ChatRequest:
    return to_chat(parsed(raw, cfg, MessagesRequest), cfg)


def _count_tokens(raw: bytes, cfg: GatewayConfig) -> ChatRequest:
    return to_chat(parsed(raw, cfg, CountTokensRequest), cfg)


def mount(gw: Gateway) -> Wing:
    async def run(adm: Admission, req: ChatRequest) -> Answer:
        gen = await adm.start(0, req)
        model = gen.context.served_as
        if req.stream:  # nothing can resume it: its close frees the engine request
            frames = render.events(gen, model, gw.cfg.heartbeat_s, gw.metrics)
            return Answer(gen.ratelimit_headers, frames=frames, close=gen.cancel)
        return Answer(gen.ratelimit_headers, body=lambda: render.whole(gen, model), close=gen.cancel)

    async def count(adm: Admission, req: ChatRequest) -> Answer:
        """`{"input_tokens": N}`: the prompt tokens a Messages request with these fields
        would report (the same template, tools and system)."""
        ids = await prepare.chat_prompt(req, adm.model, gw.cfg, tenant=adm.tenant.name)
        return Answer.ready({"input_tokens": len(ids)}, await adm.settle(0, len(ids)))

    def charge(req: ChatRequest, cfg: GatewayConfig) -> Charge:
        return Charge(req.model, [coarse_charge(req, cfg.default_max_tokens)], req.priority)

    def count_charge(req: ChatRequest, cfg: GatewayConfig) -> Charge:
        return Charge(req.model, [prompt_charge(chat_prompt_tokens(req))])

    messages = Endpoint(Api.MESSAGES, _messages, charge, run, anthropic_response)
    count_tokens = Endpoint(Api.MESSAGES, _count_tokens, count_charge, count, anthropic_response)
    return Wing(
        [
            Route("/v1/messages", route(messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", route(count_tokens), methods=["POST"]),
        ]
    )
