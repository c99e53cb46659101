"""`POST /v1/embeddings` (and the WebSocket's `embeddings` message), as OpenAI's: `input`
as a string, a list of strings, token ids or a list of token-id lists; `encoding_format`
float or base64 (little-endian float32); `dimensions`; `usage`; vectors L2-normalized.

Each input is a request of its own through the gateway's admission and the broker, as
a generate request is (`Gateway.start_prepared`): it shares the tenant's limits and the
engine's batch with the running chats. Its `SamplingParams.pooling` ("auto": the
engine's pooling for its model, `--pooling`) makes the engine run its prefill only and
send the pooled last hidden state back on the final event; normalizing and truncating
happen here.

`dimensions` keeps the first N values and normalizes again (Matryoshka-style). The
decoder-only chat models served here were not trained for it, so a truncated vector
keeps less of the text than a whole one: it is the client's choice. A `dimensions`
beyond the model's own size is a 400."""

from __future__ import annotations

import base64
import logging
import math
import struct
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from wsllm.bounds import MAX_TOKEN_ID
from wsllm.server import textwork
from wsllm.server.errors import APIError, from_generation, from_validation
from wsllm.server.fields import Inert, Strict, invalid
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.middleware import request_tenant
from wsllm.server.models import ServedModel
from wsllm.server.openai_api import read_body
from wsllm.server.prepare import Prepared
from wsllm.server.resume import Api, ResumeContext
from wsllm.server.schemas import parse_json
from wsllm.server.sse import until_disconnect
from wsllm.server.tenants import Tenant
from wsllm.types import ERR_INTERNAL, SamplingParams

log = logging.getLogger(__name__)

# Inputs longer than this in all (characters) are tokenized off the event loop; bodies
# larger than this (bytes) are validated off it.
_TOKENIZE_INLINE_CHARS = 4096
_VALIDATE_INLINE_BYTES = 64 * 1024
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class EmbeddingRequest(Strict):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = Field(None, max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)  # OpenAI's end-user id: accepted, unused
    safety_identifier: Inert

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding asked for: a text or a prompt's token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


def checked(obj: Any, max_inputs: int) -> EmbeddingRequest:
    """A parsed body as an EmbeddingRequest; APIError (400) naming the field."""
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    try:
        req = EmbeddingRequest.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
    n = len(req.inputs())
    if not 1 <= n <= max_inputs:
        raise invalid("input", f"must hold 1 to {max_inputs} inputs, got {n}")
    return req


async def _token_ids(model: ServedModel, inputs: list[str | list[int]], max_len: int) -> list[list[int]]:
    """Each input's prompt: its token ids, checked against the vocabulary and the
    model's context; a text is tokenized as a completion prompt is."""
    codec = model.codec
    texts = [x for x in inputs if isinstance(x, str)]

    def encode_all() -> list[list[int]]:
        return [codec.encode(t) for t in texts]

    if sum(map(len, texts)) > _TOKENIZE_INLINE_CHARS:
        encoded = iter(await textwork.run(encode_all))
    else:
        encoded = iter(encode_all())
    prompts = [next(encoded) if isinstance(x, str) else x for x in inputs]
    for i, ids in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input.{i}"
        if not ids:
            raise invalid(where, "must not be empty (it has no tokens)")
        if len(ids) > max_len:
            raise invalid(where, f"has {len(ids)} tokens, beyond the model's context of {max_len}")
        bad = next((t for t in ids if t >= codec.vocab_size), None)
        if bad is not None:
            raise invalid(where, f"token id {bad} is not in the vocabulary (size {codec.vocab_size})")
    return prompts


def _prepared(model: str, ids: list[int]) -> Prepared:
    params = SamplingParams(max_tokens=1, pooling="auto")  # the engine never samples it
    return Prepared(ids, params, ResumeContext.start(Api.EMBEDDINGS, model, ids, params, []))


async def _vector(gen: Generation) -> list[float]:
    """The request's pooled vector, once its one event came. GenerationError on failure."""
    while not gen.finished:
        await gen.next()
    if gen.embedding is None:
        raise GenerationError(ERR_INTERNAL, "the engine sent no embedding for this input")
    return gen.embedding


def shaped(vector: list[float], dimensions: int | None) -> bytes:
    """The first `dimensions` values (all when None), L2-normalized, as little-endian
    float32: the one form both encodings are read from, so that they agree exactly."""
    v = vector if dimensions is None else vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in v))
    scale = 1.0 / norm if norm > 0 else 1.0  # an all-zero vector stays as it is
    return struct.pack(f"<{len(v)}f", *(x * scale for x in v))


def _encoded(packed: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(packed).decode("ascii")
    return list(struct.unpack(f"<{len(packed) // 4}f", packed))


async def _start_all(
    gw: Gateway, model: ServedModel, prompts: list[list[int]], tenant: Tenant
) -> list[Generation]:
    """One admitted request per input; on a refusal, those already started end."""
    gens: list[Generation] = []
    try:
        for ids in prompts:
            gens.append(await gw.start_prepared(model, _prepared(model.name, ids), Api.EMBEDDINGS, tenant))
    except BaseException:
        for g in gens:
            await g.cancel()
        raise
    return gens


async def embed(gw: Gateway, req: EmbeddingRequest, tenant: Tenant) -> tuple[dict[str, Any], dict[str, str]]:
    """The answer's body and its rate-limit headers. Raises APIError. Cancelled (the
    client left), it ends every input's engine request."""
    model, max_len = await gw.models.resolve(req.model, tenant)
    prompts = await _token_ids(model, req.inputs(), max_len)
    gens = await _start_all(gw, model, prompts, tenant)
    try:
        vectors = [await _vector(g) for g in gens]  # they run together in the engine meanwhile
    except GenerationError as e:
        raise from_generation(e.code, e.message) from None
    finally:
        for g in gens:
            await g.cancel()  # no-op when it finished; frees the engine request otherwise
    size = len(vectors[0])
    if req.dimensions is not None and req.dimensions > size:
        raise invalid("dimensions", f"must be at most {size}, the size of {model.name}'s embeddings")
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encoded(shaped(v, req.dimensions), req.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    tokens = sum(map(len, prompts))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model.name, "usage": usage}, gens[-1].ratelimit_headers


async def embeddings(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    raw = await read_body(request, gw.cfg.max_body_bytes)
    limit = gw.cfg.max_embedding_inputs
    if len(raw) <= _VALIDATE_INLINE_BYTES:
        req = checked(parse_json(raw), limit)
    else:  # a large body must not hold up the other streams
        req = await textwork.run(lambda: checked(parse_json(raw), limit))
    done, answer = await until_disconnect(request.receive, embed(gw, req, request_tenant(request.state)))
    if not done or answer is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    body, headers = answer
    return Response(orjson.dumps(body), headers=headers, media_type="application/json")


def ws_request(obj: dict[str, Any], max_inputs: int) -> tuple[str, EmbeddingRequest]:
    """An `embeddings` WebSocket message: its `id` and the /v1/embeddings body beside it."""
    msg_id = obj.get("id")
    if not isinstance(msg_id, str) or not 1 <= len(msg_id) <= 128:
        raise APIError(400, "invalid_request", "id: a string of 1 to 128 characters", "id")
    return msg_id, checked({k: v for k, v in obj.items() if k not in ("type", "id")}, max_inputs)


async def ws_answer(gw: Gateway, msg_id: str, req: EmbeddingRequest, tenant: Tenant) -> dict[str, Any]:
    """The `embeddings` message answering one: the HTTP answer's body, with its id."""
    body, _ = await embed(gw, req, tenant)
    return {"type": "embeddings", "id": msg_id} | body
