"""Request schemas and the one validator that HTTP, SSE and the WebSocket share.

Every 400 that needs no tokenizer is raised here, while a request is validated.
Pydantic does the schema work in strict mode (no "0.5" for a number, no 1.0 for an
integer, no NaN), each number bounded by its one declaration in wsllm/types.py
(SAMPLING_BOUNDS, which SamplingParams checks again on the wire); a request's
structured-output constraint and logit_bias are worked out as it is validated; then
`validate_http` and `validate_ws` apply the operator's limits (GatewayConfig) and what
the schema cannot say about a chat's conversation (server/conversation.py).
Turning a valid request into engine SamplingParams is preparation's
(server/prepare.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from wsllm.bounds import (
    BEAM_ALONE,
    MAX_CACHE_SALT_CHARS,
    MAX_ID_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    REQUEST_BOUNDS,
)
from wsllm.config_gateway import GatewayConfig
from wsllm.server.constraints import ResponseFormat, StructuredOutputs, asked_structure, token_bias
from wsllm.server.conversation import (
    MAX_TOOLS,
    ChatMessage,
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    check_conversation,
)
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid, ranged, wire_check

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
M = TypeVar("M", bound=BaseModel)
TextPrompt = Annotated[str, Field(min_length=1)]
IdsPrompt = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: Inert  # OpenAI's padding of stream chunks: none here


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
    stream_options: StreamOptions | None = None
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
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_top_logprobs(self) -> int | None:
        """Top logprobs per token; 0 = only the chosen token's; None = no logprobs."""
        return None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = ranged("logprobs")
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model is told about (none with tool_choice "none"), in the
        shape chat templates take."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces; "" for "required"; None otherwise."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_chat(self) -> None:
        """What the schema cannot say about the messages, tools and tool_choice."""
        check_conversation(self.messages, self.tools, self.forced_tool, self.chat_template_kwargs)
        if self.structured is not None and self.forced_tool is not None:
            raise invalid("tool_choice", "a forced call cannot be combined with response_format")


class CompletionRequest(SamplingFields):
    # A string, or token ids; or a list of either (a batch, /v1/completions only: one
    # answer per prompt and choice, `index` = prompt's index * n + choice).
    prompt: (
        TextPrompt
        | IdsPrompt
        | Annotated[list[TextPrompt], Field(min_length=1)]
        | Annotated[list[IdsPrompt], Field(min_length=1)]
    )
    logprobs: int | None = ranged("logprobs")
    # the prompt's text before the answer (and, with logprobs, its tokens' logprobs)
    echo: bool | None = None
    # vLLM's: the logprobs of each prompt token and its top N, in `prompt_logprobs`
    prompt_logprobs: int | None = ranged("logprobs")
    # fill in the middle: the text after the cursor (`prompt` is the text before it);
    # the model's FIM tokens order them (server/fim.py)
    suffix: str | None = None
    # Beam search (vLLM's extension); the n best beams come back as the choices.
    use_beam_search: bool | None = None
    beam_width: int | None = ranged("beam_width")
    length_penalty: float | None = ranged("length_penalty")
    early_stopping: bool | None = None

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]] | None:
        """The prompts of a batch; None for one prompt."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return None
        return list(p)  # type: ignore[arg-type]

    @property
    def single(self) -> str | list[int]:
        """The one prompt of a request that is not a batch."""
        if self.prompts is not None:
            raise ValueError("a batch of prompts has no single prompt")
        return self.prompt  # type: ignore[return-value]

    def one(self, prompt: str | list[int]) -> CompletionRequest:
        """This request for one prompt of its batch."""
        return self.model_copy(update={"prompt": prompt})


# -- WebSocket messages (docs/protocol.md) ------------------------------------------------

WsId = Annotated[str, Field(min_length=1, max_length=128)]


class WsChat(ChatRequest):
    type: Literal["chat"]
    id: WsId


class WsCompletion(CompletionRequest):
    type: Literal["completion"]
    id: WsId


class WsCancel(Strict):
    type: Literal["cancel"]
    id: WsId


class WsResume(Strict):
    type: Literal["resume"]
    id: WsId
    after_seq: int = Field(ge=-1, le=2**31)
    resume_token: str = Field(min_length=1, max_length=512)  # from the request's `started`


class WsPing(Strict):
    type: Literal["ping"]


WsMessage = Annotated[WsChat | WsCompletion | WsCancel | WsResume | WsPing, Field(discriminator="type")]
_ws_adapter: TypeAdapter[WsChat | WsCompletion | WsCancel | WsResume | WsPing] = TypeAdapter(WsMessage)

GenerateBody = ChatRequest | CompletionRequest


# -- the one validator --------------------------------------------------------------------


def parse_json(raw: bytes | str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, "invalid_json", f"the body is not valid JSON: {e}") from e


def validate_http(model: type[ChatRequest] | type[CompletionRequest], raw: bytes, cfg: GatewayConfig) -> Any:
    """Parse and check a /v1/chat/completions or /v1/completions body."""
    req = validated(model, body_object(raw, cfg))
    check_limits(req, cfg)
    return req


def body_object(raw: bytes, cfg: GatewayConfig) -> dict[str, Any]:
    """An HTTP body: a JSON object, its message count checked before its schema."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    _check_message_count(obj, cfg)
    return obj


def validated(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None


def validate_ws(obj: Any, cfg: GatewayConfig) -> WsChat | WsCompletion | WsCancel | WsResume | WsPing:
    """Check one parsed WebSocket message."""
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "a message must be a JSON object")
    _check_message_count(obj, cfg)
    try:
        msg = _ws_adapter.validate_python(obj)
    except ValidationError as e:
        # Paths start with the message type (the union's tag) unless the type was bad.
        tagged = obj.get("type") in ("chat", "completion", "cancel", "resume", "ping")
        raise from_validation(e, skip=1 if tagged else 0) from None
    if isinstance(msg, ChatRequest | CompletionRequest):
        check_limits(msg, cfg)
    return msg


def _check_message_count(obj: dict[str, Any], cfg: GatewayConfig) -> None:
    """Before the schema: a body of many tiny messages costs its validation and its
    template time per message, so their number is capped first."""
    messages = obj.get("messages")
    if isinstance(messages, list) and len(messages) > cfg.max_messages:
        raise invalid("messages", f"at most {cfg.max_messages} messages (got {len(messages)})")


def check_limits(req: ChatRequest | CompletionRequest, cfg: GatewayConfig) -> None:
    """The operator's limits (GatewayConfig), beyond what the schema says; then, for a
    chat, what the schema cannot say about its conversation."""
    if req.n is not None and req.n > cfg.max_n:
        raise invalid("n", f"at most {cfg.max_n} (got {req.n})")
    mt = req.requested_max_tokens
    if mt is not None and mt > cfg.max_tokens_limit:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise invalid(name, f"at most {cfg.max_tokens_limit} (got {mt})")
    stops = req.stops
    if len(stops) > cfg.max_stop:
        raise invalid("stop", f"at most {cfg.max_stop} stop strings (got {len(stops)})")
    for s in stops:
        if not s or len(s) > cfg.max_stop_len:
            raise invalid("stop", f"each stop string must have 1 to {cfg.max_stop_len} characters")
    plp = getattr(req, "prompt_logprobs", None)
    if plp is not None and plp > cfg.max_top_logprobs:
        raise invalid("prompt_logprobs", f"at most {cfg.max_top_logprobs} (got {plp})")
    top = req.num_top_logprobs
    if top is not None and top > cfg.max_top_logprobs:
        param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        raise invalid(param, f"at most {cfg.max_top_logprobs} (got {top})")
    width = getattr(req, "beam_width", None)
    if width is not None and width > cfg.max_n:
        raise invalid("beam_width", f"at most {cfg.max_n} (got {width})")
    if getattr(req, "use_beam_search", None):
        if req.n is not None and req.n > (width or cfg.max_n):
            raise invalid("n", "must not exceed beam_width with use_beam_search")
        if width is None:
            wire_check("beam_width", req.n or 1)  # the width it gets is at least n
    if req.min_tokens is not None and mt is not None and req.min_tokens > mt:
        raise invalid("min_tokens", f"must not exceed max_tokens ({mt})")
    batch = req.prompts if isinstance(req, CompletionRequest) else None
    if batch is not None:
        if isinstance(req, WsCompletion):
            raise invalid(
                "prompt", "a list of prompts is for /v1/completions; send a request per prompt here"
            )
        if not 1 <= len(batch) <= cfg.max_prompts:
            raise invalid("prompt", f"a list of 1 to {cfg.max_prompts} prompts (got {len(batch)})")
    if isinstance(req, CompletionRequest) and req.suffix is not None:
        _check_suffix(req)
    if isinstance(req, ChatRequest):
        req.check_chat()


def _check_suffix(req: CompletionRequest) -> None:
    """`suffix` goes with one text prompt: the FIM prompt is built from two texts, and
    what `echo` would show (the prompt as sent) is not what the model read."""
    if req.prompts is not None:
        raise invalid("suffix", "takes one text prompt, not a list of prompts; send a request per prompt")
    if not isinstance(req.prompt, str):
        raise invalid("suffix", "takes a text prompt, not token ids")
    if req.echo:
        raise invalid("suffix", "cannot be combined with echo")
