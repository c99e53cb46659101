"""The gateway's own read-only routes: `/health` (liveness), `/ready` (an engine serves),
`/metrics` (Prometheus: the models the key may use; every model and the per-tenant
families for operators only) and `GET /v1/usage`
(what the calling key's tenant may still do and what it used, for that tenant alone).

`/v1/usage`: `limits` are the keys file's (null: unlimited); `remaining` the tenant's
buckets and in-flight requests now, shared by every gateway of a deployment (Redis);
`usage` this gateway's counts since it started, by model (the same figures as
/metrics' `wsllm_tenant_*` families)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from wsllm.server.gateway import Gateway
from wsllm.server.middleware import request_tenant

_HEALTH_PING_S = 1.0  # /health's wait for the broker's store


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _reader_running(request: Request) -> bool:
    task: asyncio.Task[None] | None = getattr(request.app.state, "router_task", None)
    return task is not None and not task.done() and _gateway(request).router.up


async def health(request: Request) -> Response:
    """Liveness: the process runs, its event reader reads (a gateway whose reader
    is down would leave every request hanging), its broker answers (a Redis that
    does not would fail every submit), and no engine it sees is stuck in a step (the
    watchdog's reason, from that engine's last heartbeat: in-process, the engine is
    this process, which exits for its supervisor to restart it), and no engine child
    of this process is down (`wsllm serve --broker redis://`: `process_health`, the
    supervisor's reason while it restarts one)."""
    why = await _unhealthy(request)
    if why is not None:
        return JSONResponse({"status": "unhealthy", "reason": why}, 503, {"retry-after": "1"})
    return JSONResponse({"status": "ok"})


async def _unhealthy(request: Request) -> str | None:
    gw = _gateway(request)
    process: Callable[[], str | None] | None = getattr(request.app.state, "process_health", None)
    if process is not None and (why := process()) is not None:
        return why
    if not _reader_running(request):
        return "the event reader is not running (it restarts by itself)"
    if not await gw.broker.reachable(_HEALTH_PING_S):
        return f"the broker did not answer within {_HEALTH_PING_S:g}s"
    stalled = [str(e.stats["stalled"]) for e in await gw.models.engines() if e.stats.get("stalled")]
    return stalled[0] if stalled else None


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
    """The page of the key's view. A key without the metrics role gets its view's page
    rendered at most once per `--metrics-cache-s` (a page costs a few ms of the gateway's
    CPU: its scrapes, however many, cost no more); an operator's is rendered fresh."""
    gw = _gateway(request)
    tenant = request_tenant(request.state)
    # the models a key may use only; tenant names and every model: operators only (and the
    # keyless gateway's anonymous tenant, the only tenant there: its own figures)
    sees_all = tenant.operator or tenant is getattr(request.app.state, "anonymous", None)
    view = ("*", "tenants") if sees_all else tenant.models
    pages: dict[tuple[str, ...], tuple[float, bytes]] = _pages(request)
    at, page = pages.get(view, (-math.inf, b""))
    if sees_all or time.monotonic() - at >= gw.cfg.metrics_cache_s:
        await gw.models.refresh_gauges()
        gw.metrics.buffered_events.set(gw.router.buffered_events())
        gw.metrics.reader_restarts.set(gw.router.restarts)
        page = gw.metrics.render(None if sees_all else tenant.may_use, tenants=sees_all)
        pages[view] = (time.monotonic(), page)
    return Response(page, media_type=CONTENT_TYPE_LATEST)


def _pages(request: Request) -> dict[tuple[str, ...], tuple[float, bytes]]:
    """The app's rendered /metrics pages, by view: (when, page)."""
    state = request.app.state
    if not hasattr(state, "metrics_pages"):
        state.metrics_pages = {}
    pages: dict[tuple[str, ...], tuple[float, bytes]] = state.metrics_pages
    return pages


async def usage(request: Request) -> Response:
    gw = _gateway(request)
    tenant = request_tenant(request.state)
    lim = tenant.limits
    now = None if lim.unlimited else await gw.limiter.usage(tenant.name, lim)
    remaining = {
        "requests": None if now is None else now.remaining_requests,
        "tokens": None if now is None else now.remaining_tokens,
        "in_flight": None if now is None or lim.max_concurrent is None else now.in_flight,
    }
    by_model = gw.metrics.tenant_usage(tenant.name)
    body = {
        "object": "usage",
        "tenant": tenant.name,
        "limits": {"rpm": lim.rpm, "tpm": lim.tpm, "max_concurrent": lim.max_concurrent},
        "remaining": remaining,
        "usage": {model: dataclasses.asdict(u) for model, u in sorted(by_model.items())},
    }
    return JSONResponse(body)


def routes() -> list[BaseRoute]:
    return [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/usage", usage),
    ]
