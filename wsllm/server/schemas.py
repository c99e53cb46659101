"""Request schemas and the one validator that HTTP, SSE and the WebSocket share.

Pydantic does the schema work in strict mode (no "0.5" for a number, no 1.0 for an
integer, no NaN), with the bounds of every numeric field from wsllm/types.py (the
engine checks the same ones); `check_limits` applies the operator's limits from
GatewayConfig. Turning a valid request into engine SamplingParams is preparation's
(server/prepare.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from wsllm.config import GatewayConfig
from wsllm.server.errors import APIError, from_validation
from wsllm.types import (
    MAX_BEAM_WIDTH,
    MAX_ID_CHARS,
    MAX_LENGTH_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_PRIORITY,
    MAX_PROMPT_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_TOP_K,
    SEED_LIMIT,
)

# Tools in one request, and tool calls in one message.
MAX_TOOLS = 128
# apply_chat_template's own arguments: not for chat_template_kwargs to set.
_TEMPLATE_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# OpenAI's range for temperature (the engine takes up to types.MAX_TEMPERATURE).
API_MAX_TEMPERATURE = 2.0
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
M = TypeVar("M", bound=BaseModel)
TextPrompt = Annotated[str, Field(min_length=1)]
IdsPrompt = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class _Strict(BaseModel):
    # An unknown field is a 400 naming it (errors.from_validation): nothing a client asks
    # for is dropped without a word. OpenAI fields that have no effect here are declared
    # as `Inert` on the models that take them (docs/protocol.md, "Fields with no effect").
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


# A field that is accepted and has no effect here (OpenAI's bookkeeping fields, and what
# clients send back in an assistant message they got); never used, never dumped.
Inert = Annotated[Any, Field(None, exclude=True)]


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Inert  # OpenAI's padding of stream chunks: none here


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(_Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of the four."""

    json_: dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF


class SamplingFields(_Strict):
    """The parameters every generate request accepts (OpenAI names, vLLM extensions).
    None means "the default"."""

    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=API_MAX_TEMPERATURE)  # below 1e-5: greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    n: int | None = Field(None, ge=1, le=MAX_N)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    user: str | None = Field(None, max_length=256)
    # OpenAI's, accepted with no effect here (docs/protocol.md, "Fields with no effect"):
    store: Inert  # stored completions
    metadata: Inert  # tags for stored completions
    service_tier: Inert  # "auto" / "default" / "flex": one tier here
    safety_identifier: Inert  # the newer name of `user`
    prompt_cache_key: Inert  # prefix caching is automatic here
    # vLLM's extension; higher is admitted first. The gateway caps it per key.
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's shape: token id (a string key) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    @property
    def structured(self) -> tuple[dict[str, Any], str] | None:
        """The SamplingParams.structured spec the request asks for, with the field that
        asked (for a 400 naming it); None for free text."""
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = {
                k: v
                for k, v in (
                    ("json", so.json_),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                )
                if v is not None
            }
            if len(given) != 1:
                raise _bad("structured_outputs", "give exactly one of json, regex, choice, grammar")
            if self.response_format is not None and self.response_format.type != "text":
                raise _bad(
                    "structured_outputs", "give either structured_outputs or response_format, not both"
                )
            return given, "structured_outputs"
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return {"json": True}, "response_format"
        if rf.json_schema is None:
            raise _bad("response_format.json_schema", 'required with "type": "json_schema"')
        schema = rf.json_schema.schema_
        return {"json": True if schema is None else schema}, "response_format.json_schema.schema"

    @property
    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise _bad("logit_bias", f"keys are token ids (0 to {MAX_TOKEN_ID}), got {key!r}")
            out[int(key)] = value
        return out

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


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def _choice_kind(v: Any) -> str:
    return "named-function" if isinstance(v, dict | NamedToolChoice) else "mode-word"


# A string, or an object naming a function; an error names the branch the input meant
# (tags that are not identifiers stay out of the error's `param`).
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode-word")]
    | Annotated[NamedToolChoice, Tag("named-function")],
    Discriminator(_choice_kind),
]


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call of an earlier assistant turn, sent back in `messages`."""

    id: str = Field(max_length=MAX_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only on an assistant message that made tool calls (checked in check_chat)
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)  # role "tool": the call it answers
    # What clients send back in an assistant message they got (OpenAI's fields, and the
    # reasoning of a reasoning model): accepted, not shown to the model.
    refusal: Inert
    annotations: Inert
    audio: Inert
    function_call: Inert
    reasoning_content: Inert

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_template_input(self) -> dict[str, Any]:
        # Templates know "system"; OpenAI's newer "developer" role means the same.
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def _template_call(c: ToolCallIn) -> dict[str, Any]:
    # Chat templates expect the arguments as a mapping (they write them with `tojson`).
    try:
        args: Any = orjson.loads(c.function.arguments)
    except orjson.JSONDecodeError:
        args = c.function.arguments
    return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
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


class CompletionRequest(SamplingFields):
    # A string, or token ids; or a list of either (a batch, /v1/completions only: one
    # answer per prompt and choice, `index` = prompt's index * n + choice).
    prompt: (
        TextPrompt
        | IdsPrompt
        | Annotated[list[TextPrompt], Field(min_length=1)]
        | Annotated[list[IdsPrompt], Field(min_length=1)]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the prompt's text before the answer (and, with logprobs, its tokens' logprobs)
    echo: bool | None = None
    # vLLM's: the logprobs of each prompt token and its top N, in `prompt_logprobs`
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Beam search (vLLM's extension); the n best beams come back as the choices.
    use_beam_search: bool | None = None
    beam_width: int | None = Field(None, ge=1, le=MAX_BEAM_WIDTH)
    length_penalty: float | None = Field(None, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
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


# -- /tokenize and /detokenize (vLLM's shapes) --------------------------------------------


class TokenizeCompletion(_Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template writes the special tokens; true is refused (it would add a second BOS).
    add_special_tokens: Literal[False] = False
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def as_chat(self) -> ChatRequest:
        """The chat request whose prompt this is (for the template and its checks)."""
        req = ChatRequest.model_construct(
            messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs
        )
        check_chat(req)
        if self.add_generation_prompt and self.continue_final_message:
            raise _bad("continue_final_message", "cannot be combined with add_generation_prompt")
        return req


class Detokenize(_Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS)


def validate_tokenize(raw: bytes, cfg: GatewayConfig) -> TokenizeCompletion | TokenizeChat:
    """A /tokenize body: `prompt` (text) or `messages` (a chat), as vLLM takes them."""
    obj = _body(raw, cfg)
    if "messages" in obj:
        return _validated(TokenizeChat, obj)
    return _validated(TokenizeCompletion, obj)


def validate_detokenize(raw: bytes, cfg: GatewayConfig) -> Detokenize:
    return _validated(Detokenize, _body(raw, cfg))


# -- WebSocket messages (docs/protocol.md) ------------------------------------------------

WsId = Annotated[str, Field(min_length=1, max_length=128)]


class WsChat(ChatRequest):
    type: Literal["chat"]
    id: WsId


class WsCompletion(CompletionRequest):
    type: Literal["completion"]
    id: WsId


class WsCancel(_Strict):
    type: Literal["cancel"]
    id: WsId


class WsResume(_Strict):
    type: Literal["resume"]
    id: WsId
    after_seq: int = Field(ge=-1, le=2**31)
    resume_token: str = Field(min_length=1, max_length=512)  # from the request's `started`


class WsPing(_Strict):
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
    req = _validated(model, _body(raw, cfg))
    check_limits(req, cfg)
    return req


def _body(raw: bytes, cfg: GatewayConfig) -> dict[str, Any]:
    """An HTTP body: a JSON object, its message count checked before its schema."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    _check_message_count(obj, cfg)
    return obj


def _validated(model: type[M], obj: dict[str, Any]) -> M:
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
        raise APIError(
            400,
            "invalid_request",
            f"messages: at most {cfg.max_messages} messages (got {len(messages)})",
            param="messages",
        )


def check_limits(req: ChatRequest | CompletionRequest, cfg: GatewayConfig) -> None:
    """The operator's limits (GatewayConfig), beyond what the schema says."""

    def bad(param: str, message: str) -> APIError:
        return APIError(400, "invalid_request", f"{param}: {message}", param=param)

    if req.n is not None and req.n > cfg.max_n:
        raise bad("n", f"at most {cfg.max_n} (got {req.n})")
    mt = req.requested_max_tokens
    if mt is not None and mt > cfg.max_tokens_limit:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise bad(name, f"at most {cfg.max_tokens_limit} (got {mt})")
    stops = req.stops
    if len(stops) > cfg.max_stop:
        raise bad("stop", f"at most {cfg.max_stop} stop strings (got {len(stops)})")
    for s in stops:
        if not s or len(s) > cfg.max_stop_len:
            raise bad("stop", f"each stop string must have 1 to {cfg.max_stop_len} characters")
    plp = getattr(req, "prompt_logprobs", None)
    if plp is not None and plp > cfg.max_top_logprobs:
        raise bad("prompt_logprobs", f"at most {cfg.max_top_logprobs} (got {plp})")
    top = req.num_top_logprobs
    if top is not None and top > cfg.max_top_logprobs:
        param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
        raise bad(param, f"at most {cfg.max_top_logprobs} (got {top})")
    width = getattr(req, "beam_width", None)
    if width is not None and width > cfg.max_n:
        raise bad("beam_width", f"at most {cfg.max_n} (got {width})")
    if getattr(req, "use_beam_search", None) and req.n is not None and req.n > (width or cfg.max_n):
        raise bad("n", "must not exceed beam_width with use_beam_search")
    if req.min_tokens is not None and mt is not None and req.min_tokens > mt:
        raise bad("min_tokens", f"must not exceed max_tokens ({mt})")
    batch = req.prompts if isinstance(req, CompletionRequest) else None
    if batch is not None:
        if isinstance(req, WsCompletion):
            raise bad("prompt", "a list of prompts is for /v1/completions; send a request per prompt here")
        if not 1 <= len(batch) <= cfg.max_prompts:
            raise bad("prompt", f"a list of 1 to {cfg.max_prompts} prompts (got {len(batch)})")
    if isinstance(req, ChatRequest):
        check_chat(req)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


def check_chat(req: ChatRequest) -> None:
    """What the schema cannot say about messages, tools and tool_choice."""
    for i, m in enumerate(req.messages):
        _check_message(i, m)
    names = [t.function.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _bad(f"tools.{i}.function.name", f"{name!r} is declared twice")
    forced = req.forced_tool
    if forced is not None and not names:
        raise _bad("tool_choice", "needs `tools` (there is no function to call)")
    if forced and forced not in names:
        raise _bad("tool_choice.function.name", f"{forced!r} is not one of the declared tools")
    for key in req.chat_template_kwargs or {}:
        if key in _TEMPLATE_RESERVED:
            raise _bad(f"chat_template_kwargs.{key}", "is set by the server; use the request's own field")


def _check_message(i: int, m: ChatMessage) -> None:
    at = f"messages.{i}"
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise _bad(f"{at}.content", f"required for a {m.role} message (null only with tool_calls)")
    if m.tool_calls is not None and m.role != "assistant":
        raise _bad(f"{at}.tool_calls", "only an assistant message has tool_calls")
    if m.role == "tool" and not m.tool_call_id:
        raise _bad(f"{at}.tool_call_id", "required for a tool message (the id of the call it answers)")
    if m.tool_call_id is not None and m.role != "tool":
        raise _bad(f"{at}.tool_call_id", "only a tool message has tool_call_id")
