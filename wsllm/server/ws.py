"""The WebSocket API, `/v1/ws`: many requests on one socket (docs/protocol.md).

One task reads client messages in order, one task writes (so that sends never
interleave), and one task per live request sends its messages. The socket owns only
itself: the cap over its live requests of every kind (--max-requests-per-socket),
`cancel` and `ping`. Every request is a wing's kind (`wing.WsKind`, one dispatch table by
message type: the OpenAI wing's `chat`, `completion` and `resume`, `responses`,
`embeddings`), run after the same admission as its HTTP route. The session
ends when either the reader or the writer stops (the client closed, a send failed, or
the client took no data for `--send-timeout-s`); then every live request leaves (a chat
request detaches where the broker keeps it, so that its owner can `resume` it on a new
socket, on any gateway, with its resume token; the rest are cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.datastructures import Headers
from starlette.websockets import WebSocket

from wsllm.broker.base import BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server import textwork
from wsllm.server.errors import APIError, from_broker, from_generation
from wsllm.server.fields import bounds_table
from wsllm.server.gateway import Gateway
from wsllm.server.generation import GenerationError
from wsllm.server.http import VALIDATE_INLINE_BYTES
from wsllm.server.middleware import request_tenant
from wsllm.server.schemas import WsCancel, parse_json, validate_ws
from wsllm.server.sockets import SocketCaps
from wsllm.server.wing import WsKind
from wsllm.types import ERR_INTERNAL

log = logging.getLogger(__name__)

CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_TRY_AGAIN = 1013  # refused at the handshake: a cap or the rpm; the reason says which
_MAX_REASON_BYTES = 123  # a close frame's reason
_CLOSE_WAIT_S = 1.0  # how long a close frame may wait on a client that does not read


def origin_allowed(headers: Headers, cfg: GatewayConfig) -> bool:
    """Browsers send Origin; other clients don't, and are let through (the API key,
    if set, still applies). The default allows only the page's own origin."""
    origin = headers.get("origin")
    if origin is None:
        return True
    allowed = [o.strip().rstrip("/") for o in cfg.allowed_origins.split(",") if o.strip()]
    if "*" in allowed:
        return True
    if allowed:
        return origin.rstrip("/") in allowed
    return urlsplit(origin).netloc == headers.get("host")


async def ws_endpoint(websocket: WebSocket) -> None:
    """The handshake is admitted before the session starts: the tenant's socket caps
    (sockets.py), then one request of its rpm; a refusal closes the socket with 1013
    (try again later) and the reason."""
    gw: Gateway = websocket.app.state.gateway
    if not origin_allowed(websocket.headers, gw.cfg):
        await websocket.close(CLOSE_POLICY)  # before accept: the handshake gets 403
        return
    tenant = request_tenant(websocket.state)
    sockets: SocketCaps = websocket.app.state.sockets
    try:
        sockets.open(tenant.name)
    except APIError as e:
        await _refuse(websocket, gw, e)
        return
    try:
        try:
            await gw.meter(tenant)
        except APIError as e:
            await _refuse(websocket, gw, e)
            return
        except BrokerError as e:
            await _refuse(websocket, gw, from_broker(e))
            return
        await websocket.accept()
        await WsSession(websocket, gw, websocket.app.state.ws_kinds).run()
    finally:
        sockets.close(tenant.name)


async def _refuse(websocket: WebSocket, gw: Gateway, err: APIError) -> None:
    """Accept and close at once with 1013 and the reason (a browser sees both; a refused
    handshake would tell it nothing)."""
    gw.metrics.error(err.code)
    await websocket.accept()
    reason = err.message.encode()[:_MAX_REASON_BYTES].decode(errors="ignore")
    with contextlib.suppress(Exception):
        await websocket.close(CLOSE_TRY_AGAIN, reason)


class SendTimeout(Exception):
    """The client took no data for --send-timeout-s."""


@dataclass(slots=True)
class _Live:
    """A request running on the socket, of any kind: how a `cancel` stops it, and how it
    leaves when the socket closes (a chat request detaches for a resume where the broker
    keeps it; the others are cancelled)."""

    cancel: Callable[[], Awaitable[None]]
    leave: Callable[[], Awaitable[None]]
    task: asyncio.Task[None] | None = None


class WsSession:
    def __init__(self, ws: WebSocket, gw: Gateway, kinds: dict[str, WsKind[Any]]) -> None:
        self.ws = ws
        self.gw = gw
        self.cfg = gw.cfg
        self.kinds = kinds  # the wings' message types (wing.py), by `type`
        # Bounded: a client that stops reading slows its own requests, nobody else's,
        # and is dropped after --send-timeout-s.
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue(maxsize=gw.cfg.ws_outbox_messages)
        #: every request running on this socket, by the client's id: the cap counts them all
        self.live: dict[str, _Live] = {}
        self.tenant = request_tenant(ws.state)  # set by the API key middleware, from the key

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for msg_id, live in list(self.live.items()):
                try:
                    await live.leave()  # cancelled, or detached for a resume
                except Exception:
                    log.exception("request %s could not leave cleanly", msg_id)
            tasks = [*(live.task for live in self.live.values() if live.task is not None), reader, writer]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if writer.done() and not writer.cancelled() and isinstance(writer.exception(), SendTimeout):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await self.ws.close(CLOSE_POLICY, "the client took no data for too long")

    async def send(self, msg: dict[str, Any]) -> None:
        await self.outbox.put(orjson.dumps(msg))

    async def _write(self) -> None:
        """Send queued messages; returns when the socket breaks, raises SendTimeout when
        the client takes no data for --send-timeout-s."""
        while True:
            data = await self.outbox.get()
            try:
                async with asyncio.timeout(self.cfg.send_timeout_s):
                    await self.ws.send_text(data.decode())
            except TimeoutError:
                self.gw.metrics.send_timeout("ws")
                log.warning("a WebSocket client took no data for %.0fs; dropping it", self.cfg.send_timeout_s)
                raise SendTimeout from None
            except (OSError, RuntimeError) as e:  # closed or broken: the session ends
                log.debug("WebSocket send failed: %s", e)
                return

    async def _read(self) -> None:
        # `bounds`: every sampling parameter's range, as declared once (bounds.SAMPLING_BOUNDS);
        # `limits`: the operator's, tighter (the UI takes both from here)
        limits = await self._limits()
        default = (
            self.gw.model_name if self.tenant.may_use(self.gw.model_name) else None
        )  # none it may not use
        await self.send({"type": "hello", "model": default, "limits": limits, "bounds": bounds_table()})
        limit = self.cfg.max_ws_message_bytes
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            size = len(raw.encode()) if raw is not None else len(message.get("bytes") or b"")
            if size > limit:
                await self.ws.close(CLOSE_TOO_BIG, f"message over {limit} bytes")
                return
            await self._handle(raw if raw is not None else message.get("bytes") or b"")

    async def _handle(self, raw: str | bytes) -> None:
        msg_id = None
        try:
            obj = parse_json(raw)
            if isinstance(obj, dict) and isinstance(obj.get("id"), str):
                msg_id = obj["id"]
            kind = self.kinds.get(str(obj.get("type"))) if isinstance(obj, dict) else None
            if kind is not None:
                await self._start_kind(kind, obj, len(raw))
                return
            msg = validate_ws(obj, self.cfg)  # the socket's own: cancel, ping
            if isinstance(msg, WsCancel):
                await self._cancel(msg.id)
            else:
                await self.send({"type": "pong"})
        except APIError as e:
            await self.api_error(msg_id, e)
        except BrokerError as e:  # e.g. Redis down during a cancel: this message fails, not the socket
            await self.api_error(msg_id, from_broker(e))
        except Exception:
            log.exception("a WebSocket message failed")
            await self.error(msg_id, ERR_INTERNAL, "internal error; see the server log")

    async def api_error(self, msg_id: str | None, e: APIError) -> None:
        """`e` as an `error` message: with `retry_after_s` where HTTP has Retry-After."""
        extra = {"retry_after_s": e.retry_after} if e.retry_after is not None else None
        await self.error(msg_id, e.code, e.message, e.param, extra)

    async def error(
        self,
        msg_id: str | None,
        code: str,
        message: str,
        param: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.gw.metrics.error(code)
        msg = {"type": "error", "id": msg_id, "code": code, "message": message, "param": param}
        await self.send(msg | (extra or {}))

    def _admit(self, msg_id: str) -> None:
        """Refuse a new request on this socket (of any kind, started or resumed) past the
        cap, or under an id that runs already."""
        if msg_id in self.live:
            raise APIError(400, "duplicate_id", f"id {msg_id!r} is already running on this socket", "id")
        if len(self.live) >= self.cfg.max_requests_per_socket:
            raise APIError(
                429,
                "too_many_requests",
                f"at most {self.cfg.max_requests_per_socket} requests at once per socket",
            )

    async def _start_kind(self, kind: WsKind[Any], obj: dict[str, Any], size: int) -> None:
        """A message of a wing's kind: the same validation, admission and work as its
        HTTP route; its messages go out with its `id`."""
        msg_id = obj.get("id")
        if not isinstance(msg_id, str) or not 1 <= len(msg_id) <= 128:
            raise APIError(400, "invalid_request", "id: a string of 1 to 128 characters", "id")
        self._admit(msg_id)
        fields = {k: v for k, v in obj.items() if k not in ("type", "id")}
        if size <= VALIDATE_INLINE_BYTES:
            req = kind.validate(fields, self.cfg)
        else:  # a large message must not hold up the other streams
            req = await textwork.run(kind.validate, fields, self.cfg)
        if kind.resume is not None:  # not admitted here: it takes its own rpm and lease
            run = await kind.resume(self.tenant, req)
        else:
            assert kind.charge is not None and kind.run is not None
            async with self.gw.admitted(self.tenant, kind.api, kind.charge(req, self.cfg)) as adm:
                run = await kind.run(adm, req)
        if run.started is not None:
            await self.send({"type": "started", "id": msg_id} | run.started)
        self._run(msg_id, _Live(run.stop, run.leave or run.stop), _with_id(msg_id, run.messages))

    async def _cancel(self, msg_id: str) -> None:
        live = self.live.get(msg_id)
        if live is None:
            raise APIError(400, "unknown_id", f"no request {msg_id!r} runs on this socket", "id")
        await live.cancel()  # a chat's stream then sends `done` with finish_reason "abort"

    def _run(self, msg_id: str, live: _Live, messages: AsyncIterator[dict[str, Any]]) -> None:
        self.live[msg_id] = live
        live.task = asyncio.create_task(self._pump(msg_id, live, messages))

    async def _pump(self, msg_id: str, live: _Live, messages: AsyncIterator[dict[str, Any]]) -> None:
        """Send a request's messages until it ends; a failure is its `error` message."""
        try:
            async for msg in messages:
                await self.send(msg)
        except GenerationError as e:
            await self.api_error(msg_id, from_generation(e.code, e.message))
        except APIError as e:
            await self.api_error(msg_id, e)
        except BrokerError as e:
            await self.api_error(msg_id, from_broker(e))
        except Exception:  # whatever failed (the broker, a bug): the request still ends with an error
            log.exception("request %s on a WebSocket: its stream failed", msg_id)
            await self.error(msg_id, ERR_INTERNAL, "internal error; see the server log")
        finally:
            if self.live.get(msg_id) is live:
                del self.live[msg_id]
            with contextlib.suppress(Exception):
                await live.leave()  # nothing when it finished

    async def _limits(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "max_requests_per_socket": c.max_requests_per_socket,
            "max_message_bytes": c.max_ws_message_bytes,
            "max_tokens": c.max_tokens_limit,
            "max_n": c.max_n,
            "max_stop": c.max_stop,
            "max_stop_len": c.max_stop_len,
            "max_context": await self.gw.models.max_model_len(),
        }


async def _with_id(msg_id: str, messages: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    async for msg in messages:
        yield {"type": msg["type"], "id": msg_id} | msg
