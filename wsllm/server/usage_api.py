"""`GET /v1/usage`: what the calling key's tenant may still do and what it used, for
that tenant alone (/metrics shows every tenant, to operators only).

`limits` are the keys file's (null: unlimited); `remaining` the tenant's buckets and
in-flight requests now, shared by every gateway of a deployment (Redis); `usage` this
gateway's counts since it started, by model (the same figures as /metrics'
`wsllm_tenant_*` families)."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.server.gateway import Gateway
from wsllm.server.middleware import request_tenant


async def usage(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
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
