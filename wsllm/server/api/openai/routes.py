"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models (and a model's
card, `GET /v1/models/{model}`), vLLM's `GET /version`, and `GET /v1/streams/{id}` to
resume a cut SSE stream (resumable brokers). Their request shapes are the gateway's own
chat and completion requests (server/schemas.py); their answers' shapes are render.py.

A stream sends one choice a chunk (OpenAI's and vLLM's: a client reads
`chunk.choices[0]`). A resumable stream must number its events the same way on every
gateway, so a request whose deltas are numbered for a replay (`Generation.replayable`)
takes one engine event a delta (the `id:` of an event is a pure function of the request's
engine events); otherwise a slow reader gets larger chunks. A streamed answer carries its
resume token in the `X-Resume-Token` header: reading the stream again needs it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import wsllm
from wsllm.config_gateway import GatewayConfig
from wsllm.server import textwork
from wsllm.server.admission import Admission
from wsllm.server.api.openai.render import AnswerView, BatchView, Shape, echo_text, usage_json, whole_answer
from wsllm.server.api.openai.ws_kinds import kinds
from wsllm.server.delta import Delta
from wsllm.server.errors import APIError
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.http import Answer, Endpoint, respond, route
from wsllm.server.metrics import Metrics
from wsllm.server.middleware import request_tenant
from wsllm.server.quota import Charge, coarse_charge
from wsllm.server.resume import Api
from wsllm.server.schemas import ChatRequest, CompletionRequest, validate_http
from wsllm.server.sse import DONE, KEEPALIVE, frame
from wsllm.server.wing import Wing

RESUME_TOKEN_HEADER = "x-resume-token"
_EVENT_ID = re.compile(r"[0-9]{1,15}")


async def sse_frames(
    metrics: Metrics, heartbeat_s: float, api: AnswerView | BatchView, after: int = 0
) -> AsyncIterator[bytes]:
    """The SSE events of a request (or a batch of them), one choice each; those numbered
    <= `after` (a resume's Last-Event-ID) are computed, to rebuild the text state, but
    not sent."""
    n = 0
    try:
        while not api.finished:
            chunks = await api.next_chunks(heartbeat_s)
            if chunks is None:
                yield KEEPALIVE
                continue
            for chunk in chunks:
                n += 1
                if n > after:
                    yield frame(n, orjson.dumps(chunk))
    except GenerationError as e:
        metrics.error(e.code)
        yield frame(n + 1, orjson.dumps(APIError(500, e.code, e.message).body()))
        yield DONE
        return
    if api.shape.include_usage:
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


async def _whole(views: list[AnswerView]) -> bytes:
    """The whole answer of one request, or of a batch of prompts (one view each)."""
    collected = list(await asyncio.gather(*(_collect(v.gen) for v in views)))
    if any(v.gen.prompt_logprobs_raw is not None for v in views):  # megabytes: off the loop
        return await textwork.run(lambda: orjson.dumps(whole_answer(views, collected)))
    return orjson.dumps(whole_answer(views, collected))


def _not_found(name: str) -> APIError:
    msg = f"The model `{name}` does not exist or you do not have access to it."  # OpenAI's words
    return APIError(404, "model_not_found", msg, param="model")


class OpenAI:
    """The wing's routes, on one gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def mount(self) -> Wing:
        chat: Endpoint[ChatRequest] = Endpoint(
            Api.CHAT, lambda raw, cfg: validate_http(ChatRequest, raw, cfg), self.charge, self.run
        )
        completions: Endpoint[CompletionRequest] = Endpoint(
            Api.COMPLETIONS,
            lambda raw, cfg: validate_http(CompletionRequest, raw, cfg),
            self.charge,
            self.run,
        )
        return Wing(
            [
                Route("/v1/models", self.models),
                Route("/v1/models/{model:path}", self.model_card),
                Route("/version", self.version),
                Route("/v1/chat/completions", route(chat), methods=["POST"]),
                Route("/v1/completions", route(completions), methods=["POST"]),
                Route("/v1/streams/{request_id}", self.resume_stream),
            ],
            kinds(self.gw),  # the WebSocket's chat, completion and resume (ws_kinds.py)
        )

    @staticmethod
    def charge(req: ChatRequest | CompletionRequest, cfg: GatewayConfig) -> Charge:
        """One coarse charge per prompt (a list of prompts is a request each)."""
        one = (
            [req]
            if isinstance(req, ChatRequest) or req.prompts is None
            else [req.one(p) for p in req.prompts]
        )
        return Charge(req.model, [coarse_charge(r, cfg.default_max_tokens) for r in one], req.priority)

    async def run(self, adm: Admission, req: ChatRequest | CompletionRequest) -> Answer:
        """Prepare and submit each prompt; the answer streams or comes whole."""
        batch = req.prompts if isinstance(req, CompletionRequest) else None
        reqs = [req] if batch is None or isinstance(req, ChatRequest) else [req.one(p) for p in batch]
        gens: list[Generation] = []
        shapes: list[Shape] = []
        try:
            for i, one in enumerate(reqs):
                try:
                    p = await adm.prepare(one)
                    shapes.append(Shape.of(one, p.prompt_ids, echo_text(adm.model.codec, one, p.prompt_ids)))
                    p.context.extras = shapes[-1].extras  # a resumed stream carries them too
                    gens.append(await adm.submit(i, p))
                except APIError as e:
                    if batch is not None and e.param == "prompt":  # name the prompt of the batch
                        e.param, e.message = f"prompt.{i}", e.message.replace("prompt", f"prompt.{i}", 1)
                    raise
        except BaseException:
            for g in gens:
                await g.cancel()
            raise
        chat = isinstance(req, ChatRequest)
        views = [AnswerView(g, g.context.served_as, chat, s) for g, s in zip(gens, shapes, strict=True)]
        return self._answer(views, req.stream)

    def _answer(self, views: list[AnswerView], stream: bool | None) -> Answer:
        gen = views[-1].gen  # the last admitted: the freshest figures
        if len(views) > 1:  # a list of prompts: not resumable, a cut stream ends them all
            batch = BatchView(views)
            if not stream:
                return Answer(gen.ratelimit_headers, body=lambda: _whole(views), close=batch.close)
            frames = sse_frames(self.gw.metrics, self.gw.cfg.heartbeat_s, batch)
            return Answer(gen.ratelimit_headers, frames=frames, close=batch.close)
        if not stream:
            return Answer(gen.ratelimit_headers, body=lambda: _whole(views), close=gen.cancel)
        headers = {RESUME_TOKEN_HEADER: gen.resume_token or ""} | gen.ratelimit_headers
        frames = sse_frames(self.gw.metrics, self.gw.cfg.heartbeat_s, views[0])
        return Answer(headers, frames=frames, close=gen.leave)  # leave: detach for a resume, or cancel

    async def resume_stream(self, request: Request) -> Response:
        """`GET /v1/streams/{request_id}` with `X-Resume-Token` (or `?resume_token=`) and
        `Last-Event-ID` (or `?last_event_id=`): the rest of a streamed completion, from
        this or any other gateway of the deployment, for the client that holds its token."""
        gw = self.gw
        rid = request.path_params["request_id"]
        raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not _EVENT_ID.fullmatch(raw):  # checked before anything starts (ASCII digits only)
            raise APIError(
                400, "invalid_request", "Last-Event-ID must be a non-negative integer", "Last-Event-ID"
            )
        # `?resume_token=` comes as the header too: the key middleware moves it out of the
        # query string, which the access log prints
        token = request.headers.get(RESUME_TOKEN_HEADER)
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
        ctx = gen.context
        shape = Shape.resumed(ctx.include_usage, ctx.extras)
        view = AnswerView(gen, ctx.served_as or gw.model_name, ctx.api.is_chat, shape)
        frames = sse_frames(gw.metrics, gw.cfg.heartbeat_s, view, after=int(raw))
        return await respond(request, gw, Answer(gen.ratelimit_headers, frames=frames, close=gen.leave))

    async def models(self, request: Request) -> Response:
        """Every model a live engine serves (and the key may use): `ServedModels.cards`."""
        data = await self.gw.models.cards(request_tenant(request.state))
        return JSONResponse({"object": "list", "data": data})

    async def model_card(self, request: Request) -> Response:
        """`GET /v1/models/{model}` (the SDK's `models.retrieve`): its card in the list, or
        a 404 that says the model does not exist (what a key may not use does not either)."""
        name = request.path_params["model"]
        data = await self.gw.models.cards(request_tenant(request.state))
        card = next((c for c in data if c["id"] == name), None)
        if card is None:
            raise _not_found(name)
        return JSONResponse(card)

    async def version(self, request: Request) -> Response:
        """vLLM's `GET /version`: this server's version."""
        return JSONResponse({"version": wsllm.__version__})


def mount(gw: Gateway) -> Wing:
    return OpenAI(gw).mount()
