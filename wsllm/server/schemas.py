"""Request schemas and the one validator that HTTP, SSE and the WebSocket share.

Every 400 that needs no tokenizer is raised here, while a request is validated.
Pydantic does the schema work in strict mode (no "0.5" for a number, no 1.0 for an
integer, no NaN), each number bounded by its one declaration in wsllm/types.py
(SAMPLING_BOUNDS, which SamplingParams checks again on the wire); the fields every
generate request shares are sampling_fields.py's (its structured-output constraint and
logit_bias are worked out as it is validated); then
`validate_http` and `validate_ws` apply the operator's limits (GatewayConfig) and what
the schema cannot say about a chat's conversation (server/conversation.py).
Turning a valid request into engine SamplingParams is preparation's
(server/prepare.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from wsllm.bounds import MAX_PROMPT_TOKENS
from wsllm.config_gateway import GatewayConfig
from wsllm.server.conversation import (
    MAX_TOOLS,
    ChatMessage,
    NamedToolChoice,
    ToolChoice,
    ToolDef,
    check_conversation,
    check_request_images,
)
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Strict, invalid, ranged, wire_check
from wsllm.server.images import ImageLimits
from wsllm.server.sampling_fields import SamplingFields, TokenId

M = TypeVar("M", bound=BaseModel)
TextPrompt = Annotated[str, Field(min_length=1)]
IdsPrompt = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = ranged("logprobs")
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's own switches; continue_final_message pre-fills the answer with
    # the last message (an assistant's), which the model continues
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's (e.g. BOS) on top of the template's
    # vLLM's: the answer starts with the last message when it is the assistant's (a pre-fill)
    echo: bool | None = None
    # vLLM's: the prompt's logprobs (its top N per token), top-level `prompt_logprobs`
    prompt_logprobs: int | None = ranged("logprobs")

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

    @property
    def echoed(self) -> str | None:
        """What `echo` puts before the answer: the last message's text when it is the
        assistant's (vLLM's rule: the same role as the answer); None otherwise."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else None

    def check_chat(self, limits: ImageLimits) -> None:
        """What the schema cannot say about the messages, tools and tool_choice; its
        images decoded and checked against `limits`."""
        check_conversation(self.messages, self.tools, self.forced_tool, self.chat_template_kwargs, limits)
        if self.structured is not None and self.forced_tool is not None:
            raise invalid("tool_choice", "a forced call cannot be combined with response_format")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "needs add_generation_prompt: false (vLLM's rule)")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs", "a chat's are not streamed (vLLM's rule); ask without stream")


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
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (e.g. BOS) of a text prompt
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


# The WebSocket's requests of the OpenAI wing (api/openai/ws_kinds.py): their fields, the
# message's `type` and `id` being the session's.


class WsChat(ChatRequest):
    """A `chat` message's request."""


class WsCompletion(CompletionRequest):
    """A `completion` message's request."""


class WsResume(Strict):
    """A `resume` message: the rest of a request cut by a disconnect."""

    after_seq: int = Field(ge=-1, le=2**31)
    resume_token: str = Field(min_length=1, max_length=512)  # from the request's `started`


# The socket's own messages (ws.py).


class WsCancel(Strict):
    type: Literal["cancel"]
    id: WsId


class WsPing(Strict):
    type: Literal["ping"]


WsMessage = Annotated[WsCancel | WsPing, Field(discriminator="type")]
_ws_adapter: TypeAdapter[WsCancel | WsPing] = TypeAdapter(WsMessage)

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
    if isinstance(req, ChatRequest):
        check_request_images(req.messages, ImageLimits.of(cfg))
    check_limits(req, cfg)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "only with stream: true")
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


def validate_ws(obj: Any, cfg: GatewayConfig) -> WsCancel | WsPing:
    """Check one parsed message of the socket's own (`cancel`, `ping`)."""
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "a message must be a JSON object")
    try:
        return _ws_adapter.validate_python(obj)
    except ValidationError as e:
        # Paths start with the message type (the union's tag) unless the type was bad.
        raise from_validation(e, skip=1 if obj.get("type") in ("cancel", "ping") else 0) from None


def validate_ws_request(
    model: type[WsChat] | type[WsCompletion], fields: dict[str, Any], cfg: GatewayConfig
) -> WsChat | WsCompletion:
    """Check a `chat` or `completion` message's fields (all but `type` and `id`)."""
    _check_message_count(fields, cfg)
    msg = validated(model, fields)
    if isinstance(msg, WsChat):
        check_request_images(msg.messages, ImageLimits.of(cfg))
    check_limits(msg, cfg)
    _check_ws_answer(msg)
    return msg


def _check_ws_answer(msg: WsChat | WsCompletion) -> None:
    """The answer fields of an HTTP chunk that a WebSocket message has no place for: a 400
    rather than dropped without a word (docs/protocol.md)."""
    so = msg.stream_options
    asked = {
        "return_token_ids": bool(msg.return_token_ids),
        "stream_options.continuous_usage_stats": so is not None and so.continuous_usage_stats,
        "echo": isinstance(msg, WsChat) and bool(msg.echo),
        "prompt_logprobs": isinstance(msg, WsChat) and msg.prompt_logprobs is not None,
    }
    for field, on in asked.items():
        if on:
            raise invalid(field, "is for the HTTP routes; the WebSocket's messages do not carry it")


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
    plp = req.prompt_logprobs
    if plp is not None and plp > cfg.max_top_logprobs:
        raise invalid("prompt_logprobs", f"at most {cfg.max_top_logprobs} (got {plp})")
    top = req.num_top_logprobs
    if top is not None and top > cfg.max_top_logprobs:
        param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        raise invalid(param, f"at most {cfg.max_top_logprobs} (got {top})")
    beams = req if isinstance(req, CompletionRequest) else None  # a completion's extension (vLLM's)
    width = beams.beam_width if beams is not None else None
    if width is not None and width > cfg.max_n:
        raise invalid("beam_width", f"at most {cfg.max_n} (got {width})")
    if beams is not None and beams.use_beam_search:
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
        req.check_chat(ImageLimits.of(cfg))


def _check_suffix(req: CompletionRequest) -> None:
    """`suffix` goes with one text prompt: the FIM prompt is built from two texts, and
    what `echo` would show (the prompt as sent) is not what the model read."""
    if req.prompts is not None:
        raise invalid("suffix", "takes one text prompt, not a list of prompts; send a request per prompt")
    if not isinstance(req.prompt, str):
        raise invalid("suffix", "takes a text prompt, not token ids")
    if req.echo:
        raise invalid("suffix", "cannot be combined with echo")
