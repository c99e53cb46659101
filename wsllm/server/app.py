"""The gateway app: `create_app(cfg, broker, tokenizer_dir)`.

The routes are the gateway's own (status.py), one wing per API (`WINGS`: each a
folder of `api/`, mounted by one line here) and the WebSocket, which answers the
wings' message kinds too. The lifespan owns the one reader task that routes
TokenEvents to requests (it restarts itself when reading fails; `/health` is 503 while
it is down). The gateway process needs only a tokenizer directory and the gateway side
of a broker: no torch, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, WebSocketRoute
from starlette.staticfiles import StaticFiles

from wsllm.broker.base import BrokerError, GatewayBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server import programs, status, textwork
from wsllm.server.api.adapters import routes as adapters
from wsllm.server.api.embeddings import routes as embeddings
from wsllm.server.api.messages import routes as messages
from wsllm.server.api.openai import routes as openai
from wsllm.server.api.responses import routes as responses
from wsllm.server.api.tokenize import routes as tokenize
from wsllm.server.errors import ANTHROPIC_PREFIX, APIError, anthropic_response, from_broker
from wsllm.server.gateway import Gateway
from wsllm.server.metrics import Metrics
from wsllm.server.middleware import (
    ApiKeyMiddleware,
    HostMiddleware,
    JsonBodyMiddleware,
    SecurityHeadersMiddleware,
)
from wsllm.server.sockets import SocketCaps
from wsllm.server.tenants import Tenants, anonymous_tenant
from wsllm.server.text import TextCodec
from wsllm.server.wing import Wing
from wsllm.server.ws import ws_endpoint

log = logging.getLogger(__name__)

#: one per API: a new API is a folder of api/ and a line here
WINGS: tuple[Callable[[Gateway], Wing], ...] = (
    openai.mount,
    responses.mount,
    messages.mount,
    embeddings.mount,
    tokenize.mount,
    adapters.mount,
)


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    _gateway(request).metrics.error(exc.code)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    err = APIError(exc.status_code, code, str(exc.detail))
    return anthropic_response(err) if request.url.path.startswith(ANTHROPIC_PREFIX) else err.response()


async def _broker_error(request: Request, exc: Exception) -> Response:
    """A broker error that no route turned into an answer: the broker is full, closing
    or unreachable; the client may retry."""
    assert isinstance(exc, BrokerError)
    return await _api_error(request, from_broker(exc))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    _gateway(request).metrics.error("internal_error")
    return APIError(500, "internal_error", "internal error; see the server log").response()


def default_frontend_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "frontend"


def freeze_startup_heap() -> None:
    """Move every object alive once loading is done (the model's and the tokenizers' Python
    objects, the engine's tables) out of the garbage collector's reach (`gc.freeze`, as vLLM
    does). A full collection walks every tracked object: with them it took 260-340 ms here,
    holding the GIL, every stream of the engine stopped (the amplification bench's worst gap
    was one, docs/benchmarks.md); they live as long as the process, so walking them finds
    nothing."""
    gc.collect()
    gc.freeze()


@contextlib.asynccontextmanager
async def _lifespan(gw: Gateway, app: Starlette) -> AsyncIterator[None]:
    """The app's life: the heap frozen, the one event reader running, until it stops."""
    freeze_startup_heap()
    task = asyncio.create_task(gw.router.run(), name="wsllm-event-router")
    app.state.router_task = task
    try:
        yield
    finally:
        await gw.aclose()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.unfreeze()  # an app made and shut down in a longer-lived process (tests): collectable again


def create_app(
    cfg: GatewayConfig,
    broker: GatewayBroker,
    tokenizer_dir: str | Path,
    model_name: str | None = None,
    frontend_dir: str | Path | None = None,
    tokenizer_dirs: dict[str, Path] | None = None,
) -> Starlette:
    """The gateway app. `model_name` (default: the tokenizer directory's name) is the
    default model, whose tokenizer is `tokenizer_dir`; `tokenizer_dirs` gives other
    models' tokenizers (the rest come from what their engines publish)."""
    name = model_name or Path(tokenizer_dir).name
    textwork.configure(cfg.text_work_threads, cfg.text_work_nice)
    programs.configure(cfg.template_threads, cfg.spec_check_workers, cfg.text_work_nice)
    tenants = Tenants.from_settings(cfg.api_key, cfg.api_keys_file)  # a bad keys file stops here
    anonymous = anonymous_tenant(
        cfg.anonymous_rpm, cfg.anonymous_tpm, cfg.anonymous_max_concurrent, cfg.anonymous_operator
    )
    gw = Gateway(
        cfg,
        broker,
        TextCodec(str(tokenizer_dir)),
        name,
        Metrics(name),
        tokenizer_dirs=dict(tokenizer_dirs or {}),
    )

    wings = [mount(gw) for mount in WINGS]
    routes: list[BaseRoute] = [*status.routes(), *(r for w in wings for r in w.routes)]
    routes.append(WebSocketRoute("/v1/ws", ws_endpoint))
    static = Path(frontend_dir) if frontend_dir is not None else default_frontend_dir()
    if cfg.frontend and (static / "index.html").is_file():
        routes.append(Mount("/", StaticFiles(directory=static, html=True), name="frontend"))
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(SecurityHeadersMiddleware),
            Middleware(HostMiddleware, allowed_hosts=cfg.allowed_hosts, bind_host=cfg.host),
            Middleware(ApiKeyMiddleware, tenants=tenants, anonymous=anonymous),
            Middleware(JsonBodyMiddleware),
        ],
        exception_handlers={
            APIError: _api_error,
            BrokerError: _broker_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=functools.partial(_lifespan, gw),
    )
    app.state.gateway = gw
    app.state.ws_kinds = {kind: k for w in wings for kind, k in w.ws.items()}
    app.state.sockets = SocketCaps(cfg.max_sockets_per_tenant, cfg.max_sockets)
    app.state.anonymous = anonymous  # a keyless gateway's one tenant (status.py: /metrics)
    return app


def uvicorn_config(app: Starlette, cfg: GatewayConfig, **overrides: object) -> uvicorn.Config:
    """uvicorn settings that follow GatewayConfig (WS frame limit, keepalive pings);
    `log_level` comes from LogConfig (`--log-level`)."""
    kwargs: dict[str, object] = dict(
        host=cfg.host,
        port=cfg.port,
        ws_max_size=cfg.max_ws_message_bytes,  # larger frames close the socket with 1009
        ws_ping_interval=cfg.heartbeat_s,
        ws_ping_timeout=max(cfg.heartbeat_s * 2, 5.0),
        timeout_graceful_shutdown=5,
        log_level="info",
    )
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)  # type: ignore[arg-type]
