"""OpenAI's Responses API: `POST /v1/responses` (streamed, whole, or in the
background), `GET` and `DELETE /v1/responses/{id}`, `GET .../input_items` and
`POST .../cancel`, and the WebSocket's `responses` message (always streamed, each typed
event in a `response_event`).

A request is validated (request.py), admitted, then continued from its stored
conversation, translated into the chat request every route prepares (translate.py) and
submitted (run.py); its answer is rendered by render.py. Cancellation: a streamed or
whole answer runs while its client waits for it; closing the stream (or the
connection) cancels it and frees its engine request, as on the chat route. A
`background` answer runs on the gateway that took it; `cancel` stops it there, or
through the broker from another gateway, and so does `DELETE`, which leaves a tombstone
that the stopped run cannot store itself over. GET, cancel, DELETE and input_items each
take one request of the tenant's rpm. A response is not resumable (no `starting_after`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wsllm.broker.base import BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server.admission import Admission
from wsllm.server.api.responses.render import Event, input_item
from wsllm.server.api.responses.request import ResponsesRequest, responses_request, validate_responses
from wsllm.server.api.responses.run import ResponseRun, Responses, charge, not_found
from wsllm.server.errors import APIError, from_broker
from wsllm.server.gateway import Gateway
from wsllm.server.http import Answer, Endpoint, route
from wsllm.server.middleware import request_tenant
from wsllm.server.resume import Api
from wsllm.server.sse import KEEPALIVE
from wsllm.server.wing import Wing, WsKind, WsRun

# How long a cancel waits for the cancelled response's end to be stored, and its first
# and longest pause between reads of the record (each read doubles the pause).
_CANCEL_WAIT_S = 5.0
_FIRST_READ_S, _LONGEST_READ_S = 0.05, 0.5


def _sse(ev: Event) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (ev["type"].encode(), orjson.dumps(ev))


async def _frames(batches: AsyncIterator[list[Event]]) -> AsyncIterator[bytes]:
    async for batch in batches:
        if not batch:
            yield KEEPALIVE
        for ev in batch:
            yield _sse(ev)


def _json(obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json", headers=headers)


def _engine_request(response_id: str) -> str:
    """The id of the engine request that makes a response."""
    return "resp-" + response_id.removeprefix("resp_")


def _ws_fields(obj: dict[str, Any], cfg: GatewayConfig) -> ResponsesRequest:
    """A `responses` message's fields: a Responses body, always streamed, never in the
    background (that is for `POST /v1/responses`)."""
    if obj.get("background"):
        raise APIError(400, "invalid_request", "background: use POST /v1/responses", "background")
    return responses_request({k: v for k, v in obj.items() if k != "stream"}, cfg)


class ResponsesWing:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.state = Responses(gw.broker.response_store(), gw.cfg, gw.metrics)

    def mount(self) -> Wing:
        create = Endpoint(Api.RESPONSES, validate_responses, charge, self.create)
        routes = [
            Route("/v1/responses", route(create), methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
        ]
        return Wing(routes, {"responses": WsKind(Api.RESPONSES, _ws_fields, charge, self.ws_run)})

    async def create(self, adm: Admission, req: ResponsesRequest) -> Answer:
        run = await self.state.start(adm, req)
        gen, cfg = run.gen, self.gw.cfg
        if req.background:
            return await self._background(run)
        if req.stream:  # not resumable: a closed stream ends the response
            return Answer(
                gen.ratelimit_headers, frames=_frames(run.batches(cfg.heartbeat_s)), close=gen.cancel
            )

        async def body() -> bytes:
            return orjson.dumps(await run.whole())

        return Answer(gen.ratelimit_headers, body=body, close=gen.cancel)

    async def ws_run(self, adm: Admission, req: ResponsesRequest) -> WsRun:
        run = await self.state.start(adm, req)

        async def messages() -> AsyncIterator[dict[str, Any]]:
            try:
                async for batch in run.batches(None):
                    for ev in batch:
                        yield {"type": "response_event", "event": ev}
            finally:
                await run.gen.cancel()  # nothing when it finished

        return WsRun(
            {"request_id": run.gen.request_id, "response_id": run.builder.id}, messages(), run.gen.cancel
        )

    async def _background(self, run: ResponseRun) -> Answer:
        """Answer at once with the response in progress (stored), and run it here until it
        ends or is cancelled; each end is stored for `GET`."""
        rid = run.builder.id
        await run.keeper.keep(run.builder)

        async def finish() -> None:
            try:
                await run.in_background()
            finally:
                self.state.background.pop(rid, None)

        self.state.background[rid] = (run.gen, self.gw.spawn(finish()))
        return Answer.ready(run.builder.response, run.gen.ratelimit_headers)

    async def _stored(self, request: Request) -> dict[str, Any]:
        rid = request.path_params["response_id"]
        return await self.state.stored(rid, request_tenant(request.state).name)

    async def _meter(self, request: Request) -> dict[str, str]:
        """One request of the tenant's rpm for a call on a stored response (a 429 past
        it); its x-ratelimit-* headers."""
        return await self.gw.meter(request_tenant(request.state))

    async def _stop(self, rid: str) -> bool:
        """Stop a background response: here, or through the broker where another gateway
        runs it. True when it ran here (its end is stored by now, or within the wait)."""
        local = self.state.background.get(rid)
        if local is not None:
            gen, task = local
            await gen.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_WAIT_S)
            return True
        try:
            await self.gw.broker.abort(_engine_request(rid))
        except BrokerError as e:
            raise from_broker(e) from None
        return False

    async def cancel(self, request: Request) -> Response:
        """`POST /v1/responses/{id}/cancel`: stop a background response of this key's
        tenant and answer it as stored (`cancelled`; unchanged when it had ended). It runs
        on this gateway (cancelled here) or on another of the deployment (aborted through
        the broker; that gateway stores the end, read here with growing pauses)."""
        headers = await self._meter(request)
        rid = request.path_params["response_id"]
        record = await self._stored(request)
        if not record["response"].get("background"):
            raise APIError(
                400, "invalid_request", "only a background response can be cancelled", "response_id"
            )
        if rid not in self.state.background and record["response"]["status"] != "in_progress":
            return _json(record["response"], headers)
        if not await self._stop(rid):
            loop = asyncio.get_running_loop()
            deadline, pause = loop.time() + _CANCEL_WAIT_S, _FIRST_READ_S
            while record["response"]["status"] == "in_progress" and loop.time() < deadline:
                await asyncio.sleep(pause)
                pause = min(2 * pause, _LONGEST_READ_S)
                record = await self._stored(request)
        return _json((await self._stored(request))["response"], headers)

    async def get(self, request: Request) -> Response:
        """A stored response, for a key of the tenant that made it."""
        headers = await self._meter(request)
        if request.query_params.get("stream", "false").lower() == "true":
            raise APIError(
                400,
                "invalid_request",
                "stream: only background responses stream again; none run here",
                "stream",
            )
        return _json((await self._stored(request))["response"], headers)

    async def input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items`: the conversation the response answered
        (the turns of the responses it continued, then its own input), with `order`
        (`desc` by default), `limit` (1 to 100, 20) and `after` (an item id), as OpenAI's."""
        headers = await self._meter(request)
        record = await self._stored(request)
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
        return _json(body, headers)

    async def delete(self, request: Request) -> Response:
        """`DELETE /v1/responses/{id}`: the record goes, a tombstone stays (a run still
        going cannot store it again), and a background response still running stops."""
        headers = await self._meter(request)
        rid, tenant = request.path_params["response_id"], request_tenant(request.state).name
        record = await self.state.stored(rid, tenant)  # 404 for an unknown id or another key's
        if not await self.state.store.delete(rid, tenant, self.gw.cfg.response_ttl_s):
            raise not_found(rid, "response_id")
        running = rid in self.state.background or record["response"]["status"] == "in_progress"
        if record["response"].get("background") and running:
            await self._stop(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True}, headers=headers)


def mount(gw: Gateway) -> Wing:
    return ResponsesWing(gw).mount()
