"""vLLM's `POST /tokenize` and `POST /detokenize`, for the served models: what a
prompt (or a chat's messages, through the model's template) costs in tokens before
sending it, and the text of token ids. Same API key, model names and limits as the
generate routes (docs/protocol.md, "Tokenize and detokenize"). Each call takes one
request of the tenant's rpm before the tokenizer runs (`Gateway.meter`) and, after it,
its token count from the tenant's tpm (`Gateway.charge_work`): a tokenizer pass over a
prompt is work a tenant could otherwise multiply for free."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.server import prepare, textwork
from wsllm.server.gateway import Gateway
from wsllm.server.middleware import request_tenant
from wsllm.server.openai_api import read_body
from wsllm.server.schemas import validate_detokenize, validate_tokenize

_INLINE_TOKENS = 4096  # answers up to this many tokens are built on the loop (well under a ms)


async def tokenize(request: Request) -> Response:
    """`{"prompt": ...}` or `{"messages": [...]}` -> `{"count", "max_model_len", "tokens",
    "token_strs"}` (`token_strs` with `"return_token_strs": true`, else null)."""
    gw: Gateway = request.app.state.gateway
    req = validate_tokenize(await read_body(request, gw.cfg.max_body_bytes), gw.cfg)
    tenant = request_tenant(request.state)
    model, max_len = await gw.models.resolve(req.model, tenant)
    headers = await gw.meter(tenant, model.svc.metrics)
    ids = await prepare.tokenize(req, model, gw.cfg)
    await gw.charge_work(tenant, len(ids))

    def answer() -> bytes:
        # vLLM's token_strs: the vocabulary's own strings (byte-level: "Ġworld" for " world")
        strs = model.codec.token_strs(ids) if req.return_token_strs else None
        return orjson.dumps({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})

    # a long prompt's answer is megabytes of JSON: built off the loop
    raw = answer() if len(ids) <= _INLINE_TOKENS else await textwork.run(answer)
    return Response(raw, headers=headers, media_type="application/json")


async def detokenize(request: Request) -> Response:
    """`{"tokens": [...]}` -> `{"prompt": text}` (special tokens kept)."""
    gw: Gateway = request.app.state.gateway
    req = validate_detokenize(await read_body(request, gw.cfg.max_body_bytes), gw.cfg)
    tenant = request_tenant(request.state)
    model, _ = await gw.models.resolve(req.model, tenant)
    headers = await gw.meter(tenant, model.svc.metrics)
    text = await prepare.detokenize(req, model.codec)
    await gw.charge_work(tenant, len(req.tokens))
    return JSONResponse({"prompt": text}, headers=headers)
