"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

`code` is the same machine-readable word on HTTP and on the WebSocket (see
docs/protocol.md); `type` follows OpenAI's names."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.responses import Response

from wsllm.broker.base import BrokerClosed, BrokerError, BrokerUnavailable, QueueFull
from wsllm.types import (
    ERR_ENGINE_BUSY,
    ERR_ENGINE_STALLED,
    ERR_INVALID_REQUEST,
    ERR_QUEUE_TIMEOUT,
    ERR_WORKER_LOST,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error to answer with; raise it anywhere below a route."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["retry-after"] = str(self.retry_after)
        return Response(orjson.dumps(self.body()), self.status, headers, media_type="application/json")


# A request the engine side could not serve for now (full, late or lost): 503 and
# Retry-After on HTTP, `retry_after_s` on the WebSocket.
_RETRY_LATER = frozenset({ERR_ENGINE_BUSY, ERR_QUEUE_TIMEOUT, ERR_WORKER_LOST, ERR_ENGINE_STALLED})


def from_generation(code: str, message: str) -> APIError:
    """A failure reported for a running request (a GenerationError's code and message)
    as the error to answer with: 400 when the engine refused the request, 503 to retry
    when it was full, late or lost, 500 otherwise."""
    if code == ERR_INVALID_REQUEST:
        return APIError(400, code, message)
    if code in _RETRY_LATER:
        return APIError(503, code, message, retry_after=1)
    return APIError(500, code, message)


def from_broker(e: BrokerError) -> APIError:
    """A broker error met while admitting, resuming or cancelling a request: 429 when
    its queue is full, 503 otherwise (closing, unreachable); the client may retry."""
    if isinstance(e, QueueFull):
        return APIError(429, "queue_full", f"the server is busy: {e}", retry_after=1)
    if isinstance(e, BrokerClosed):
        why = "the server is shutting down"
    elif isinstance(e, BrokerUnavailable):
        why = "the broker is unreachable; retry"
    else:
        why = str(e)
    return APIError(503, "model_not_ready", why, retry_after=1)


def from_validation(e: ValidationError, skip: int = 0) -> APIError:
    """The first problem pydantic found, named by its field path. `skip` drops leading
    path parts (a discriminated union's tag). A union field fails once per branch;
    those messages are joined."""
    errors = e.errors(include_url=False)
    param = _param(errors[0]["loc"][skip:])
    msgs = []
    for err in errors:
        if _param(err["loc"][skip:]) != param:
            continue
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; this server does not take it"
        elif err["type"] != "missing" and "input" in err:
            msg = f"{msg} (got {_short(err['input'])})"
        if msg not in msgs:
            msgs.append(msg)
    text = "; or ".join(msgs)
    return APIError(400, "invalid_request", f"{param}: {text}" if param else text, param=param)


def _param(loc: tuple[int | str, ...]) -> str | None:
    # Keep field names and list indexes; drop the branch tags pydantic adds for unions
    # ("constrained-str", "list[int]", "function-after[...]").
    parts = [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Anthropic's error types by status (its Messages routes answer in its shape).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"  # the routes that answer errors in Anthropic's shape


def anthropic_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_response(err: APIError) -> Response:
    """`err` in Anthropic's shape, with its status and headers (Retry-After too)."""
    headers = dict(err.headers)
    if err.retry_after is not None:
        headers["retry-after"] = str(err.retry_after)
    return Response(orjson.dumps(anthropic_body(err)), err.status, headers, media_type="application/json")
