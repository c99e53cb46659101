"""Pure ASGI middleware (no BaseHTTPMiddleware: it breaks streaming): the Host
allow-list and the API key (which names the request's tenant)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from wsllm.server.errors import ANTHROPIC_PREFIX, APIError, anthropic_response
from wsllm.server.tenants import ANONYMOUS, Tenant, Tenants

# Paths the key protects: the API, the WebSocket, (de)tokenize, metrics and readiness. The chat
# UI's static files and /health (liveness probes) stay public; the UI asks for the
# key and passes it on the WebSocket.
PROTECTED_PREFIXES = ("/v1", "/metrics", "/ready", "/tokenize", "/detokenize")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = ("", "0.0.0.0", "::")
TENANT_STATE = "tenant"  # the key in scope["state"]


def route_path(scope: Scope) -> str:
    """The path the app routes on: without the `root_path` a proxy mounts it under
    (Starlette routes the same way, so the key is checked on what gets served)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


async def _refuse(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
        return
    anthropic = route_path(scope).startswith(ANTHROPIC_PREFIX)
    await (anthropic_response(err) if anthropic else err.response())(scope, receive, send)


class HostMiddleware:
    """Serve only the Host names listed (empty: the loopback names and the address
    the server listens on; `*`: any). A keyless server on localhost is otherwise
    reachable from any web page through DNS rebinding: the page's own origin then
    passes the WebSocket's same-origin check."""

    def __init__(self, app: ASGIApp, allowed_hosts: str, bind_host: str) -> None:
        self.app = app
        names = [h.strip().lower() for h in allowed_hosts.split(",") if h.strip()]
        if not names:
            names = list(LOOPBACK_HOSTS)
            if bind_host not in _WILDCARD_BINDS:
                names.append(bind_host.lower())
        self.any = "*" in names
        self.allowed = {n.strip("[]") for n in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any or scope["type"] not in ("http", "websocket") or self._ok(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(400, "invalid_host", "this server does not serve that Host name (see --allowed-hosts)")
        await _refuse(scope, receive, send, err)

    def _ok(self, scope: Scope) -> bool:
        host = Headers(scope=scope).get("host", "").strip().lower()
        if host.startswith("["):  # [::1]:8000
            name = host[1:].partition("]")[0]
        else:
            name = host.rpartition(":")[0] if host.count(":") == 1 else host
        return name in self.allowed


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's
    header) (or, on the WebSocket handshake, where
    browsers cannot set headers, `?api_key=<key>`) to be a key of one of `tenants`,
    compared in constant time, and puts that tenant in `scope["state"]["tenant"]`
    (`request.state.tenant`): only this middleware sets it, from the key, never from
    anything else the client sends. Without tenants (no key configured) every client
    is `anonymous`, with GatewayConfig's `anonymous_*` limits. The key is taken out of
    the query string before anything logs it."""

    def __init__(self, app: ASGIApp, tenants: Tenants | None, anonymous: Tenant = ANONYMOUS) -> None:
        self.app = app
        self.tenants = tenants
        self.anonymous = anonymous  # every client when no key is configured

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            tenant = self._tenant(scope)
            _drop_key_from_query(scope)  # uvicorn's access log reads this same scope
            if tenant is None and route_path(scope).startswith(PROTECTED_PREFIXES):
                err = APIError(
                    401, "invalid_api_key", "a valid API key is required: Authorization: Bearer <key>"
                )
                await _refuse(scope, receive, send, err)
                return
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)

    def _tenant(self, scope: Scope) -> Tenant | None:
        if self.tenants is None:
            return self.anonymous
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            found = self.tenants.authenticate(token.strip())
            if found is not None:
                return found
        if "x-api-key" in headers:  # Anthropic's clients send the key here
            found = self.tenants.authenticate(headers["x-api-key"].strip())
            if found is not None:
                return found
        if scope["type"] == "websocket":
            for name, token in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
                if name == "api_key":
                    found = self.tenants.authenticate(token)
                    if found is not None:
                        return found
        return None


def request_tenant(state: Any) -> Tenant:
    """The tenant the API key middleware found for this request (`request.state`)."""
    tenant = getattr(state, TENANT_STATE, None)
    return tenant if isinstance(tenant, Tenant) else ANONYMOUS


#: a resume token given in the query string (`GET /v1/streams/{id}?resume_token=`, for
#: clients that cannot set headers) travels on as this header, out of the query
RESUME_TOKEN_HEADER = b"x-resume-token"
_SECRETS = ("api_key", "resume_token")  # query parameters no log may see


def _drop_key_from_query(scope: Scope) -> None:
    """Take the secrets out of the query string, which uvicorn's access log prints: the
    API key (read already), and a resume token, handed to the route as its header."""
    raw: bytes = scope.get("query_string", b"")
    if not any(name.encode() in raw for name in _SECRETS):
        return
    query = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    token = next((v for k, v in query if k == "resume_token"), None)
    headers = list(scope.get("headers", []))
    if token is not None and not any(k.lower() == RESUME_TOKEN_HEADER for k, _ in headers):
        scope["headers"] = [*headers, (RESUME_TOKEN_HEADER, token.encode("latin-1"))]
    scope["query_string"] = urlencode([(k, v) for k, v in query if k not in _SECRETS]).encode("latin-1")


# The UI's policy, sent as headers: a <meta> tag cannot carry `frame-ancestors` (so a
# page could frame the UI and click through it), and it covers only HTML pages.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "style-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),  # frame-ancestors for browsers that predate it
)
# POST routes whose body is JSON: under these prefixes, every POST.
JSON_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class SecurityHeadersMiddleware:
    """Adds the content security policy, `frame-ancestors 'none'` and `nosniff` to every
    HTTP response (the UI's pages, the API's JSON, its errors)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                message = message | {"headers": list(message.get("headers", [])) + extra}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class JsonBodyMiddleware:
    """A POST to a JSON route must say `Content-Type: application/json` (415 otherwise).
    A form or `text/plain` POST is a "simple" request that any web page can send
    cross-origin without a CORS preflight: served, it would let any site queue work on
    a keyless gateway on localhost. A JSON one needs the preflight, which we never grant."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and _is_json_route(scope):
            ctype = Headers(scope=scope).get("content-type", "")
            if ctype.partition(";")[0].strip().lower() != "application/json":
                err = APIError(
                    415,
                    "unsupported_media_type",
                    f"this route takes a JSON body: Content-Type must be application/json (got {ctype!r})",
                )
                await _refuse(scope, receive, send, err)
                return
        await self.app(scope, receive, send)


def _is_json_route(scope: Scope) -> bool:
    path = route_path(scope)
    return path.startswith(JSON_PREFIXES)
