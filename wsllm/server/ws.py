"""The WebSocket API, `/v1/ws`: many requests on one socket (docs/protocol.md).

One task reads client messages in order, one task writes (so that sends never
interleave), and one task per live request turns its deltas into messages. The
session ends when either the reader or the writer stops (the client closed, a send
failed, or the client took no data for `--send-timeout-s`); then every live request
leaves (`Generation.leave`: cancelled, or detached with a resumable broker so that
its owner can `resume` it on a new socket, on any gateway, with its resume token).
While a request waits for an engine, its task sends `queued` with its place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.datastructures import Headers
from starlette.websockets import WebSocket

from wsllm.broker.base import BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server import embeddings_api, textwork
from wsllm.server.errors import APIError, from_broker, from_generation
from wsllm.server.fields import bounds_table
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Delta, Generation, GenerationError
from wsllm.server.middleware import request_tenant
from wsllm.server.responses_api import ResponseRun, start_response
from wsllm.server.responses_schema import responses_request
from wsllm.server.resume import Api
from wsllm.server.schemas import WsCancel, WsChat, WsCompletion, WsResume, parse_json, validate_ws
from wsllm.types import ERR_INTERNAL

log = logging.getLogger(__name__)

CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
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
    gw: Gateway = websocket.app.state.gateway
    if not origin_allowed(websocket.headers, gw.cfg):
        await websocket.close(CLOSE_POLICY)  # before accept: the handshake gets 403
        return
    await websocket.accept()
    await WsSession(websocket, gw).run()


class SendTimeout(Exception):
    """The client took no data for --send-timeout-s."""


class WsSession:
    def __init__(self, ws: WebSocket, gw: Gateway) -> None:
        self.ws = ws
        self.gw = gw
        self.cfg = gw.cfg
        # Bounded: a client that stops reading slows its own requests, nobody else's,
        # and is dropped after --send-timeout-s.
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue(maxsize=gw.cfg.ws_outbox_messages)
        self.gens: dict[str, Generation] = {}
        self.tenant = request_tenant(ws.state)  # set by the API key middleware, from the key
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for gen in list(self.gens.values()):
                try:
                    await gen.leave()  # cancelled, or detached for a resume
                except Exception:
                    log.exception("request %s could not leave cleanly", gen.request_id)
            tasks = [*self.tasks.values(), reader, writer]
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
        await self.send(
            {"type": "hello", "model": self.gw.model_name, "limits": limits, "bounds": bounds_table()}
        )
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
            if isinstance(obj, dict) and obj.get("type") == "responses":
                await self._start_response(obj, len(raw))
                return
            if isinstance(obj, dict) and obj.get("type") == "embeddings":
                await self._start_embeddings(obj)
                return
            if len(raw) <= 64 * 1024:
                msg = validate_ws(obj, self.cfg)
            else:  # a large message must not hold up the other streams
                msg = await textwork.run(validate_ws, obj, self.cfg)
            if isinstance(msg, WsCancel):
                await self._cancel(msg.id)
            elif isinstance(msg, WsChat | WsCompletion):
                await self._start(msg)
            elif isinstance(msg, WsResume):
                await self._resume(msg)
            else:
                await self.send({"type": "pong"})
        except APIError as e:
            await self.api_error(msg_id, e)
        except BrokerError as e:  # e.g. Redis down during a cancel: this message fails, not the socket
            err = from_broker(e)
            await self.error(msg_id, err.code, err.message)
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
        """Refuse a new live request on this socket (started or resumed) past the cap."""
        if msg_id in self.gens:
            raise APIError(400, "duplicate_id", f"id {msg_id!r} is already running on this socket", "id")
        if len(self.gens) >= self.cfg.max_requests_per_socket:
            raise APIError(
                429,
                "too_many_requests",
                f"at most {self.cfg.max_requests_per_socket} requests at once per socket",
            )

    async def _start(self, msg: WsChat | WsCompletion) -> None:
        self._admit(msg.id)
        api = Api.WS_CHAT if isinstance(msg, WsChat) else Api.WS_COMPLETION
        gen = await self.gw.start(msg, api, self.tenant)
        self.gens[msg.id] = gen
        started = {"type": "started", "id": msg.id, "request_id": gen.request_id}
        await self.send(started | {"resume_token": gen.resume_token})
        self.tasks[msg.id] = asyncio.create_task(self._stream(msg.id, gen))

    async def _start_response(self, obj: dict[str, Any], size: int) -> None:
        """A `responses` message: OpenAI's Responses body (responses_api.py), always
        streamed, its typed events each in a `response_event`; not resumable."""
        msg_id = obj.get("id")
        if not isinstance(msg_id, str) or not 1 <= len(msg_id) <= 128:
            raise APIError(400, "invalid_request", "id: a string of 1 to 128 characters", "id")
        self._admit(msg_id)
        body = {k: v for k, v in obj.items() if k not in ("type", "id", "stream")}
        if body.get("background"):
            raise APIError(400, "invalid_request", "background: use POST /v1/responses", "background")
        if size <= 64 * 1024:
            req = responses_request(body, self.cfg)
        else:  # a large message must not hold up the other streams
            req = await textwork.run(responses_request, body, self.cfg)
        run = await start_response(self.gw, req, self.tenant)
        self.gens[msg_id] = run.gen
        ids = {"request_id": run.gen.request_id, "response_id": run.builder.id}
        await self.send({"type": "started", "id": msg_id} | ids)
        self.tasks[msg_id] = asyncio.create_task(self._stream_response(msg_id, run))

    async def _start_embeddings(self, obj: dict[str, Any]) -> None:
        """An `embeddings` message: /v1/embeddings' body (embeddings_api.py), answered by
        one `embeddings` message or an `error`; the socket's close cancels it."""
        msg_id, req = embeddings_api.ws_request(obj, self.cfg.max_embedding_inputs)
        self._admit(msg_id)
        if msg_id in self.tasks:
            raise APIError(400, "duplicate_id", f"id {msg_id!r} is already running on this socket", "id")

        async def answer() -> None:
            try:
                await self.send(await embeddings_api.ws_answer(self.gw, msg_id, req, self.tenant))
            except APIError as e:
                await self.api_error(msg_id, e)
            except BrokerError as e:
                await self.api_error(msg_id, from_broker(e))
            except Exception:
                log.exception("an embeddings message failed")
                await self.error(msg_id, ERR_INTERNAL, "internal error; see the server log")
            finally:
                self.tasks.pop(msg_id, None)

        self.tasks[msg_id] = asyncio.create_task(answer())

    async def _stream_response(self, msg_id: str, run: ResponseRun) -> None:
        try:
            async for batch in run.batches(None):
                for ev in batch:
                    await self.send({"type": "response_event", "id": msg_id, "event": ev})
        finally:
            if self.gens.get(msg_id) is run.gen:
                self.gens.pop(msg_id, None)
                self.tasks.pop(msg_id, None)
            with contextlib.suppress(Exception):
                await run.gen.cancel()  # nothing when it finished

    async def _resume(self, msg: WsResume) -> None:
        """Continue a request cut by a disconnect: replay it and send the deltas after
        `after_seq`. It takes the request's resume token; with the memory broker a
        request ends with its socket, so every resume is `unknown_id`."""
        self._admit(msg.id)
        gen = await self.gw.resume(msg.resume_token, tenant=self.tenant)
        if gen is None:
            raise APIError(
                400,
                "unknown_id",
                "no request to resume with this token (it ended with its socket, expired, or is not yours)",
                "resume_token",
            )
        self.gens[msg.id] = gen
        self.tasks[msg.id] = asyncio.create_task(self._stream(msg.id, gen, after_seq=msg.after_seq))

    async def _cancel(self, msg_id: str) -> None:
        gen = self.gens.get(msg_id)
        if gen is None:
            raise APIError(400, "unknown_id", f"no request {msg_id!r} runs on this socket", "id")
        await gen.cancel()  # its task sends `done` with finish_reason "abort"

    async def _stream(self, msg_id: str, gen: Generation, after_seq: int = -1) -> None:
        """Send a request's deltas (those numbered after `after_seq`) and dones."""
        seq = 0
        open_choices = len(gen.choices)
        queued = QueuedNotice(self, msg_id, gen)
        try:
            while open_choices:
                deltas = await gen.next(timeout=queued.wait_s())
                if not deltas:
                    await queued.tell()
                    continue
                for d in deltas:
                    for msg in self._messages(msg_id, d):
                        if seq > after_seq:
                            await self.send(msg | {"seq": seq})
                        seq += 1
                    if d.finish_reason is not None:
                        open_choices -= 1
                        await self.send(self._done(msg_id, gen, d, last=open_choices == 0))
        except GenerationError as e:
            await self.api_error(msg_id, from_generation(e.code, e.message))
        except Exception:  # whatever failed (the broker, a bug): the request still ends with an error
            log.exception("request %s: its stream failed", gen.request_id)
            await self.error(msg_id, ERR_INTERNAL, "internal error; see the server log")
        finally:
            if self.gens.get(msg_id) is gen:
                self.gens.pop(msg_id, None)
                self.tasks.pop(msg_id, None)
            with contextlib.suppress(Exception):
                await gen.leave()  # nothing when it finished

    @classmethod
    def _messages(cls, msg_id: str, d: Delta) -> list[dict[str, Any]]:
        """A delta's messages (their `seq` still to set): its reasoning, then its text
        and tool calls."""
        out = (
            [{"type": "reasoning", "id": msg_id, "index": d.index, "text": d.reasoning}]
            if d.reasoning
            else []
        )
        if d.text or d.tool_calls:
            out.append(cls._delta(msg_id, d))
        return out

    @staticmethod
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

    @staticmethod
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
        return out

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


class QueuedNotice:
    """`queued` messages for a request that waits for an engine: its place in the
    queue, sent when it changes, every `queue_poll_s` (brokers that can tell)."""

    def __init__(self, session: WsSession, msg_id: str, gen: Generation) -> None:
        self.session = session
        self.msg_id = msg_id
        self.gen = gen
        self.broker = session.gw.broker
        self.last: int | None = None

    def wait_s(self) -> float | None:
        """How long the next read may wait: the poll interval until the request starts."""
        waiting = self.broker.resumable and not self.gen.started and not self.gen.finished
        return self.broker.queue_poll_s if waiting else None

    async def tell(self) -> None:
        if self.gen.started or self.gen.finished:
            return
        try:
            place = await self.broker.position(self.gen.request_id)
        except Exception:  # a position is a courtesy: never fail the request over it
            log.debug("no queue position for %s", self.gen.request_id, exc_info=True)
            return
        if place and place != self.last:
            self.last = place
            await self.session.send({"type": "queued", "id": self.msg_id, "position": place})
