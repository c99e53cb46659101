"""The body of `POST /v1/embeddings` (and the WebSocket's `embeddings` message), as
OpenAI's: `input` as a string, a list of strings, token ids or a list of token-id
lists; `encoding_format` float or base64; `dimensions`; `user`. Every 400 of its shape
is here; what needs the tokenizer (an input too long, a token id outside the
vocabulary) is preparation's (server/prepare.py, `embeddings`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from wsllm.bounds import MAX_TOKEN_ID
from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid
from wsllm.server.quota import Coarse, text_tokens
from wsllm.server.schemas import parse_json

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

    def charges(self) -> list[Coarse]:
        """Each input's coarse charge: its prompt (estimated from a text's bytes, exact for
        token ids) plus one."""
        return [
            Coarse(text_tokens(x) + 1, 1) if isinstance(x, str) else Coarse(len(x) + 1, len(x) + 1)
            for x in self.inputs()
        ]


def checked(obj: Any, cfg: GatewayConfig) -> EmbeddingRequest:
    """A parsed body (or a WebSocket message's fields) as an EmbeddingRequest; APIError
    (400) naming the field."""
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    try:
        req = EmbeddingRequest.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
    n = len(req.inputs())
    if not 1 <= n <= cfg.max_embedding_inputs:
        raise invalid("input", f"must hold 1 to {cfg.max_embedding_inputs} inputs, got {n}")
    return req


def validate(raw: bytes, cfg: GatewayConfig) -> EmbeddingRequest:
    return checked(parse_json(raw), cfg)
