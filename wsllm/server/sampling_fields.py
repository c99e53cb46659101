"""The fields every generate request accepts (`SamplingFields`: OpenAI's names and vLLM's
extensions, the base of the chat and completion requests of schemas.py) and their
`stream_options`. Each number is bounded by its one declaration (bounds.SAMPLING_BOUNDS);
the structured-output constraint and logit_bias are worked out as a request is validated."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, PrivateAttr, model_validator

from wsllm.bounds import (
    BEAM_ALONE,
    MAX_CACHE_SALT_CHARS,
    MAX_ID_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    REQUEST_BOUNDS,
)
from wsllm.server.constraints import ResponseFormat, StructuredOutputs, asked_structure, token_bias
from wsllm.server.errors import APIError
from wsllm.server.fields import Inert, Strict, ranged

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class StreamOptions(Strict):
    # None: as `continuous_usage_stats` (which asks for usage: vLLM's default is true)
    include_usage: bool | None = None
    # vLLM's: every chunk carries the usage so far, not only the last one
    continuous_usage_stats: bool = False
    include_obfuscation: Inert  # OpenAI's padding of stream chunks: none here

    @property
    def usage(self) -> bool:
        return self.continuous_usage_stats if self.include_usage is None else self.include_usage


class SamplingFields(Strict):
    """The parameters every generate request accepts (OpenAI names, vLLM extensions).
    None means "the default"."""

    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    max_tokens: int | None = ranged("max_tokens")
    max_completion_tokens: int | None = ranged("max_tokens")
    temperature: float | None = ranged("temperature")  # below 1e-5: greedy
    top_p: float | None = ranged("top_p")
    top_k: int | None = ranged("top_k")  # -1 or 0: off
    min_p: float | None = ranged("min_p")
    presence_penalty: float | None = ranged("presence_penalty")
    frequency_penalty: float | None = ranged("frequency_penalty")
    repetition_penalty: float | None = ranged("repetition_penalty")
    seed: int | None = ranged("seed")
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = ranged("stop_token_ids")
    n: int | None = ranged("n")
    ignore_eos: bool | None = None
    min_tokens: int | None = ranged("min_tokens")
    user: str | None = Field(None, max_length=256)
    # OpenAI's, accepted with no effect here (docs/protocol.md, "Fields with no effect"):
    store: Inert  # stored completions
    metadata: Inert  # tags for stored completions
    service_tier: Inert  # "auto" / "default" / "flex": one tier here
    safety_identifier: Inert  # the newer name of `user`
    prompt_cache_key: Inert  # prefix caching is automatic here
    # vLLM's: the request shares cached prefix blocks only with requests of its tenant that
    # give the same salt (a tenant's requests share them among themselves without one)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's extension; higher is admitted first. The gateway caps it per key.
    priority: int = ranged("priority", REQUEST_BOUNDS, 0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None  # with `stream` only (a 400 without, as OpenAI's)
    # vLLM's: the prompt's token ids and each choice's (`prompt_token_ids`, `token_ids`)
    return_token_ids: bool | None = None
    # vLLM's: keep the prompt's last N tokens (-1: as many as leave room for max_tokens in the context)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_PROMPT_TOKENS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's shape: token id (a string key) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = ranged("logit_bias")
    # Worked out while the request is validated (see `structured` and `token_bias`).
    _structured: tuple[dict[str, Any], str] | None = PrivateAttr(None)
    _token_bias: dict[int, float] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _constraints(self) -> SamplingFields:
        self._structured = asked_structure(self.structured_outputs, self.response_format)
        self._token_bias = token_bias(self.logit_bias)
        if getattr(self, "use_beam_search", None) and (self._structured or self._token_bias):
            raise APIError(400, "invalid_request", BEAM_ALONE)
        return self

    @property
    def structured(self) -> tuple[dict[str, Any], str] | None:
        """The SamplingParams.structured spec the request asks for, with the field that
        asked (for a 400 naming it); None for free text."""
        return self._structured

    @property
    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with token ids for keys; None when empty."""
        return self._token_bias

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: the usage so far in every chunk."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    @property
    def num_top_logprobs(self) -> int | None:
        """Top logprobs per token; 0 = only the chosen token's; None = no logprobs."""
        return None
