"""vLLM's `POST /tokenize` and `POST /detokenize`, for the served models: what a
prompt (or a chat's messages, through the model's template) costs in tokens before
sending it, and the text of token ids. Same API key, model names and limits as the
generate routes (docs/protocol.md, "Tokenize and detokenize"): each call is admitted
like any other (its tenant's rpm, a concurrency lease and its prompt's coarse charge)
before the tokenizer runs, and settles at its token count after: a tokenizer pass over
a prompt is work a tenant could otherwise multiply for free."""

from __future__ import annotations

import orjson
from starlette.routing import Route

from wsllm.server import prepare, textwork
from wsllm.server.admission import Admission
from wsllm.server.api.tokenize.request import (
    Detokenize,
    TokenizeChat,
    TokenizeCompletion,
    charge,
    validate_detokenize,
    validate_tokenize,
)
from wsllm.server.gateway import Gateway
from wsllm.server.http import Answer, Endpoint, route
from wsllm.server.resume import Api
from wsllm.server.wing import Wing

_INLINE_TOKENS = 4096  # answers up to this many tokens are built on the loop (well under a ms)


def mount(gw: Gateway) -> Wing:
    async def tokenize(adm: Admission, req: TokenizeCompletion | TokenizeChat) -> Answer:
        """`{"prompt": ...}` or `{"messages": [...]}` -> `{"count", "max_model_len", "tokens",
        "token_strs"}` (`token_strs` with `"return_token_strs": true`, else null)."""
        model = adm.model
        if isinstance(req, TokenizeChat):
            ids = await prepare.chat_prompt(req.as_chat(gw.cfg), model, gw.cfg, tenant=adm.tenant.name)
        else:
            ids = await prepare.text_tokens(model, req.prompt, req.add_special_tokens)
        headers = await adm.settle(0, len(ids))

        def answer() -> bytes:
            # vLLM's token_strs: the vocabulary's own strings (byte-level: "Ġworld" for " world")
            strs = model.codec.token_strs(ids) if req.return_token_strs else None
            body = {"count": len(ids), "max_model_len": adm.max_len, "tokens": ids, "token_strs": strs}
            return orjson.dumps(body)

        # a long prompt's answer is megabytes of JSON: built off the loop
        return Answer.ready(answer() if len(ids) <= _INLINE_TOKENS else await textwork.run(answer), headers)

    async def detokenize(adm: Admission, req: Detokenize) -> Answer:
        """`{"tokens": [...]}` -> `{"prompt": text}` (special tokens kept)."""
        text = await prepare.detokenize(adm.model.codec, req.tokens)
        return Answer.ready({"prompt": text}, await adm.settle(0, len(req.tokens)))

    return Wing(
        [
            Route(
                "/tokenize",
                route(Endpoint(Api.TOKENIZE, validate_tokenize, charge, tokenize)),
                methods=["POST"],
            ),
            Route(
                "/detokenize",
                route(Endpoint(Api.TOKENIZE, validate_detokenize, charge, detokenize)),
                methods=["POST"],
            ),
        ]
    )
