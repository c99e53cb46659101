"""vLLM's `POST /tokenize` and `POST /detokenize`, for the served models: what a
prompt (or a chat's messages, through the model's template) costs in tokens before
sending it, and the text of token ids. Same API key, model names and limits as the
generate routes (docs/protocol.md, "Tokenize and detokenize")."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wsllm.server.gateway import Gateway
from wsllm.server.middleware import request_tenant
from wsllm.server.openai_api import read_body
from wsllm.server.schemas import validate_detokenize, validate_tokenize


async def tokenize(request: Request) -> Response:
    """`{"prompt": ...}` or `{"messages": [...]}` -> `{"count", "max_model_len", "tokens",
    "token_strs"}` (`token_strs` with `"return_token_strs": true`, else null)."""
    gw: Gateway = request.app.state.gateway
    req = validate_tokenize(await read_body(request, gw.cfg.max_body_bytes), gw.cfg)
    ids, max_len, codec = await gw.tokenize(req, request_tenant(request.state))
    # vLLM's token_strs: the vocabulary's own strings (byte-level: "Ġworld" for " world")
    strs = [codec.backend.id_to_token(t) for t in ids] if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    """`{"tokens": [...]}` -> `{"prompt": text}` (special tokens kept)."""
    gw: Gateway = request.app.state.gateway
    req = validate_detokenize(await read_body(request, gw.cfg.max_body_bytes), gw.cfg)
    return JSONResponse({"prompt": await gw.detokenize(req, request_tenant(request.state))})
