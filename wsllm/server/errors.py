"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

`code` is the same machine-readable word on HTTP and on the WebSocket (see
docs/protocol.md); `type` follows OpenAI's names."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with; raise it anywhere below a route."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after

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
        headers = {"retry-after": str(self.retry_after)} if self.retry_after is not None else None
        return Response(orjson.dumps(self.body()), self.status, headers, media_type="application/json")


def from_validation(e: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    # Drop union-branch tags pydantic puts in paths (e.g. "str", "list[int]", "chat").
    param = ".".join(p for p in loc if not _is_tag(p)) or None
    msg = err["msg"]
    if err["type"] not in ("missing", "extra_forbidden") and "input" in err:
        msg = f"{msg} (got {_short(err['input'])})"
    return APIError(400, "invalid_request", f"{param}: {msg}" if param else msg, param=param)


def _is_tag(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "function-after")
        or "[" in part
        or part.startswith("function")
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
