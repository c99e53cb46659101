"""The gateway app: `create_app(cfg, broker, tokenizer_dir)`.

The lifespan owns the one reader task that routes TokenEvents to requests (it
restarts itself when reading fails; `/health` is 503 while it is down). The
gateway process needs only a tokenizer directory and a broker: no torch, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from wsllm.broker.base import Broker, BrokerError
from wsllm.config_gateway import GatewayConfig
from wsllm.server import (
    embeddings_api,
    messages_api,
    openai_api,
    responses_api,
    textwork,
    tokenize_api,
    usage_api,
)
from wsllm.server.errors import ANTHROPIC_PREFIX, APIError, anthropic_response, from_broker
from wsllm.server.gateway import Gateway
from wsllm.server.metrics import Metrics
from wsllm.server.middleware import (
    ApiKeyMiddleware,
    HostMiddleware,
    JsonBodyMiddleware,
    SecurityHeadersMiddleware,
    request_tenant,
)
from wsllm.server.tenants import Tenants, anonymous_tenant
from wsllm.server.text import TextCodec
from wsllm.server.ws import ws_endpoint

log = logging.getLogger(__name__)

_HEALTH_PING_S = 1.0  # /health's wait for the broker's store


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _reader_running(request: Request) -> bool:
    task: asyncio.Task[None] | None = getattr(request.app.state, "router_task", None)
    return task is not None and not task.done() and _gateway(request).router.up


async def health(request: Request) -> Response:
    """Liveness: the process runs, its event reader reads (a gateway whose reader
    is down would leave every request hanging) and its broker answers (a Redis that
    does not would fail every submit)."""
    why = None
    if not _reader_running(request):
        why = "the event reader is not running (it restarts by itself)"
    elif not await _gateway(request).broker.reachable(_HEALTH_PING_S):
        why = f"the broker did not answer within {_HEALTH_PING_S:g}s"
    if why is not None:
        return JSONResponse({"status": "unhealthy", "reason": why}, 503, {"retry-after": "1"})
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    gw = _gateway(request)
    running = _reader_running(request)
    # the registry is cached for a second: a Redis that stopped meanwhile must not read as ready
    reachable = running and await gw.broker.reachable(_HEALTH_PING_S)
    engines = await gw.models.engines() if reachable else []
    if not running or not engines:
        why = "the event reader is not running" if not running else "no engine is serving yet"
        if running and not reachable:
            why = f"the broker did not answer within {_HEALTH_PING_S:g}s"
        return JSONResponse({"status": "not_ready", "reason": why}, 503, {"retry-after": "1"})
    return JSONResponse({"status": "ready", "model": gw.model_name, "engines": len(engines)})


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    await gw.models.refresh_gauges()
    gw.metrics.buffered_events.set(gw.router.buffered_events())
    gw.metrics.reader_restarts.set(gw.router.restarts)
    page = gw.metrics.render(tenants=request_tenant(request.state).operator)  # names: operators only
    return Response(page, media_type=CONTENT_TYPE_LATEST)


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


def create_app(
    cfg: GatewayConfig,
    broker: Broker,
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
    tenants = Tenants.from_settings(cfg.api_key, cfg.api_keys_file)  # a bad keys file stops here
    anonymous = anonymous_tenant(cfg.anonymous_rpm, cfg.anonymous_tpm, cfg.anonymous_max_concurrent)
    gw = Gateway(
        cfg,
        broker,
        TextCodec(str(tokenizer_dir)),
        name,
        Metrics(name),
        tokenizer_dirs=dict(tokenizer_dirs or {}),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
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

    routes: list[BaseRoute] = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", openai_api.models),
        Route("/v1/usage", usage_api.usage),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/streams/{request_id}", openai_api.resume_stream),
        Route("/v1/messages", messages_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_api.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses_api.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses_api.list_input_items),
        Route("/v1/responses/{response_id}/cancel", responses_api.cancel_response, methods=["POST"]),
        Route("/v1/embeddings", embeddings_api.embeddings, methods=["POST"]),
        Route("/tokenize", tokenize_api.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize_api.detokenize, methods=["POST"]),
        WebSocketRoute("/v1/ws", ws_endpoint),
    ]
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
        lifespan=lifespan,
    )
    app.state.gateway = gw
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
