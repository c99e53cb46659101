"""Pure ASGI middleware (no BaseHTTPMiddleware: it breaks streaming)."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from wsllm.server.errors import APIError

# Paths the key protects: the API, the WebSocket, metrics and readiness. The chat
# UI's static files and /health (liveness probes) stay public; the UI asks for the
# key and passes it on the WebSocket.
PROTECTED_PREFIXES = ("/v1", "/metrics", "/ready")


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (or, on the WebSocket handshake, where
    browsers cannot set headers, `?api_key=<key>`), compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.key is None
            or scope["type"] not in ("http", "websocket")
            or not scope["path"].startswith(PROTECTED_PREFIXES)
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
            return
        err = APIError(401, "invalid_api_key", "a valid API key is required: Authorization: Bearer <key>")
        await err.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key):
            return True
        if scope["type"] == "websocket":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            for token in query.get("api_key", []):
                if hmac.compare_digest(token.encode(), self.key):
                    return True
        return False
