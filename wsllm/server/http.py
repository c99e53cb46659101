"""The route skeleton every HTTP API shares, written once (`route`): take one request of
its tenant's rpm (429 before the body is read), read the body (413 past
--max-body-bytes), validate it (inline, or off the event loop when large), **admit** it
(its tenant's concurrency and coarse token charge, through `Gateway.admitted`, before
any work), run it, answer it whole or as Server-Sent Events
(499 when the client left first; whatever still runs is cancelled however the call
ends), and answer a failure in the API's own error shape.

An API fills in only what is its own (`Endpoint`): its request's validation (every 400
its shape can name), its charge, what it runs once admitted (an `Answer`), and its
error shape. The WebSocket runs the same endpoints' `run` after the same admission
(ws.py), so no API can decide for itself when to admit."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from wsllm.broker.base import BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server import textwork
from wsllm.server.admission import Admission
from wsllm.server.errors import APIError, from_broker, from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import GenerationError
from wsllm.server.middleware import request_tenant
from wsllm.server.quota import Charge
from wsllm.server.resume import Api
from wsllm.server.sse import EventStream, until_disconnect

log = logging.getLogger(__name__)

Req = TypeVar("Req")
# Bodies larger than this are validated off the event loop (a large one must not hold up
# the other streams).
VALIDATE_INLINE_BYTES = 64 * 1024


async def _nothing() -> None:
    return None


@dataclass(slots=True)
class Answer:
    """What a call answers, once admitted and started: streamed (`frames`: SSE frames)
    or whole (`body`: computes the JSON body, waiting for what runs). `close` runs
    however the call ends (finished, failed, the client gone): it cancels (or detaches)
    what still runs."""

    headers: dict[str, str] = field(default_factory=dict)
    frames: AsyncIterator[bytes] | None = None
    body: Callable[[], Awaitable[bytes]] | None = None
    close: Callable[[], Awaitable[None]] = _nothing

    @classmethod
    def ready(cls, obj: object, headers: dict[str, str] | None = None) -> Answer:
        """A body computed already (JSON bytes, or what orjson writes as them)."""
        raw = obj if isinstance(obj, bytes) else orjson.dumps(obj)

        async def body() -> bytes:
            return raw

        return cls(headers or {}, body=body)


def openai_error(err: APIError) -> Response:
    return err.response()


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req]):
    """What one route of an API fills in of the skeleton."""

    #: the API it is (metrics, request ids)
    api: Api
    #: the raw body (or a WebSocket message's fields, as JSON) as a checked request: every
    #: 400 its shape can name, and no tokenizer, template or broker
    validate: Callable[[bytes, GatewayConfig], Req]
    #: what admission takes for it (quota.Charge), from the checked request alone
    charge: Callable[[Req, GatewayConfig], Charge]
    #: its work, admitted
    run: Callable[[Admission, Req], Awaitable[Answer]]
    #: a failure in the API's own shape
    error: Callable[[APIError], Response] = openai_error


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


async def validated(validate: Callable[[bytes, GatewayConfig], Req], raw: bytes, cfg: GatewayConfig) -> Req:
    """`validate(raw, cfg)`, on the loop for a small body, off it for a large one."""
    if len(raw) <= VALIDATE_INLINE_BYTES:
        return validate(raw, cfg)
    return await textwork.run(validate, raw, cfg)


def route(endpoint: Endpoint[Req]) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette handler of `endpoint`: the skeleton above."""

    async def handle(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        tenant = request_tenant(request.state)
        try:
            paid = await gw.pay_request(tenant)  # a key past its rpm: refused before its body is read
            raw = await read_body(request, gw.cfg.max_body_bytes)
            req = await validated(endpoint.validate, raw, gw.cfg)
            charge = endpoint.charge(req, gw.cfg)
            async with gw.admitted(tenant, endpoint.api, charge, paid) as adm:
                answer = await endpoint.run(adm, req)
            return await respond(request, gw, answer)
        except BrokerError as e:
            err = from_broker(e)
        except APIError as e:
            err = e
        except Exception:
            log.exception("unhandled error on %s", request.url.path)
            err = APIError(500, "internal_error", "internal error; see the server log")
        gw.metrics.error(err.code)
        return endpoint.error(err)

    return handle


async def respond(request: Request, gw: Gateway, answer: Answer) -> Response:
    """`answer` as an SSE stream, or whole: 499 when the client left before it was
    ready. What still runs is cancelled however it ends."""
    if answer.frames is not None:
        return EventStream(
            answer.frames,
            on_close=answer.close,
            send_timeout_s=gw.cfg.send_timeout_s,
            on_timeout=lambda: gw.metrics.send_timeout("sse"),
            headers=answer.headers,
        )
    assert answer.body is not None, "an answer is streamed or whole"
    try:
        done, raw = await until_disconnect(request.receive, answer.body())
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        await answer.close()  # a no-op when it finished; frees the engine requests otherwise
    if not done or raw is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return Response(raw, headers=answer.headers, media_type="application/json")
