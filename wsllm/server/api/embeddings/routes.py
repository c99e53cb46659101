"""`POST /v1/embeddings` and the WebSocket's `embeddings` message. Each input is a
request of its own, admitted (its charge: its prompt plus one), prepared
(server/prepare.py) and queued like a generate request: it shares the tenant's limits
and the engine's batch with the running chats. Its `SamplingParams.pooling` ("auto":
the engine's pooling for its model, `--pooling`) makes the engine run its prefill only
and send the pooled last hidden state back on the final event; render.py shapes it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.routing import Route

from wsllm.config_gateway import GatewayConfig
from wsllm.server import prepare
from wsllm.server.admission import Admission
from wsllm.server.api.embeddings.render import answer
from wsllm.server.api.embeddings.request import EmbeddingRequest, checked, validate
from wsllm.server.errors import from_generation
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.http import Answer, Endpoint, route
from wsllm.server.quota import Charge
from wsllm.server.resume import Api
from wsllm.server.wing import Wing, WsKind, WsRun
from wsllm.types import ERR_INTERNAL, FINISH_ABORT


def charge(req: EmbeddingRequest, cfg: GatewayConfig) -> Charge:
    return Charge(req.model, req.charges())


async def start(adm: Admission, req: EmbeddingRequest) -> list[Generation]:
    """One admitted request per input, prepared and submitted; on a failure, those
    already submitted end."""
    gens: list[Generation] = []
    try:
        for i, prep in enumerate(await prepare.embeddings(adm.model, req.inputs(), adm.max_len)):
            gens.append(await adm.submit(i, prep))
    except BaseException:
        for g in gens:
            await g.cancel()
        raise
    return gens


class _Cancelled(Exception):
    """The client cancelled the call (a WebSocket `cancel`): nothing is answered."""


async def _vector(gen: Generation) -> list[float]:
    """The request's pooled vector, once its one event came. GenerationError on failure."""
    while not gen.finished:
        if any(d.finish_reason == FINISH_ABORT for d in await gen.next()):
            raise _Cancelled
    if gen.embedding is None:
        raise GenerationError(ERR_INTERNAL, "the engine sent no embedding for this input")
    return gen.embedding


async def _body(gens: list[Generation], req: EmbeddingRequest, model: str) -> dict[str, Any]:
    vectors = [await _vector(g) for g in gens]  # they run together in the engine meanwhile
    tokens = sum(g.prompt_len for g in gens)
    return answer(vectors, req.dimensions, req.encoding_format, model, tokens)


async def _cancel_all(gens: list[Generation]) -> None:
    for g in gens:
        await g.cancel()  # a no-op when it finished; frees the engine request otherwise


async def run(adm: Admission, req: EmbeddingRequest) -> Answer:
    gens = await start(adm, req)

    async def body() -> bytes:
        return orjson.dumps(await _body(gens, req, adm.model.served_as))

    return Answer(gens[-1].ratelimit_headers, body=body, close=lambda: _cancel_all(gens))


async def ws_run(adm: Admission, req: EmbeddingRequest) -> WsRun:
    """One `embeddings` message answers it: the HTTP answer's body (or an `error`; a
    `cancel` stops it, and nothing is answered)."""
    gens = await start(adm, req)

    async def messages() -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"type": "embeddings"} | await _body(gens, req, adm.model.served_as)
        except _Cancelled:
            return
        except GenerationError as e:
            raise from_generation(e.code, e.message) from None
        finally:
            await _cancel_all(gens)

    return WsRun(None, messages(), lambda: _cancel_all(gens))


def mount(gw: Gateway) -> Wing:
    endpoint = Endpoint(Api.EMBEDDINGS, validate, charge, run)
    return Wing(
        [Route("/v1/embeddings", route(endpoint), methods=["POST"])],
        {"embeddings": WsKind(Api.EMBEDDINGS, checked, charge, ws_run)},
    )
