"""The body of `POST /v1/responses` (OpenAI's Responses API) and its translation into
the chat request that every other route prepares (`to_chat`): `instructions` become
a system message, input items become messages (a `function_call` joins the assistant
turn before it, a `function_call_output` is a tool message), function tools and
`tool_choice` take chat's shapes, and `text.format` becomes `response_format`.

Items are kept between turns in one plain shape (`Turn`: a dict per message, call or
call output; reasoning is not shown to the model again, as with chat's
`reasoning_content`), which is also what a stored response keeps for
`previous_response_id`. Every 400 that the Responses shape can name is raised here,
with its Responses field path; what only the tokenizer can tell comes from
preparation and is renamed by `renamed`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError

from wsllm.bounds import MAX_ID_CHARS, REQUEST_BOUNDS
from wsllm.config_gateway import GatewayConfig
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid, ranged
from wsllm.server.schemas import ChatRequest, parse_json, validate_http

#: an item of a conversation in its kept shape (see the module's docstring)
Turn = dict[str, Any]
_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
_ID = Field(max_length=MAX_ID_CHARS)


def _str_or_list(v: Any) -> str:
    return "text-content" if isinstance(v, str) else "part-list"


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Inert  # output_text sent back as it came
    logprobs: Inert


class OtherPart(Strict):
    """Images, files and audio: named, then refused with a 400 that says so."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]
    model_config = {"extra": "allow"}


# Union tags that are not identifiers stay out of an error's `param` (errors.from_validation),
# so a 400 names the field as the client wrote it: `input.0.content.1.text`.
def _part_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "text-part" if kind in ("input_text", "output_text") else "other-part"


Part = Annotated[
    Annotated[InputText, Tag("text-part")] | Annotated[OtherPart, Tag("other-part")],
    Discriminator(_part_kind),
]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[
        Annotated[str, Tag("text-content")] | Annotated[list[Part], Tag("part-list")],
        Discriminator(_str_or_list),
    ]
    id: Inert
    status: Inert
    phase: Inert


class CallItem(Strict):
    type: Literal["function_call"]
    call_id: str = _ID
    name: str = Field(pattern=_NAME)
    arguments: str
    id: Inert
    status: Inert


class CallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = _ID
    output: Annotated[
        Annotated[str, Tag("text-content")] | Annotated[list[InputText], Tag("part-list")],
        Discriminator(_str_or_list),
    ]
    id: Inert
    status: Inert


class ReasoningItem(Strict):
    """Reasoning sent back: accepted, not shown to the model again."""

    type: Literal["reasoning"]
    id: Inert
    summary: Inert
    content: Inert
    encrypted_content: Inert
    status: Inert


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return f"{kind}-item" if isinstance(kind, str) else "message-item"


Item = Annotated[
    Annotated[MessageItem, Tag("message-item")]
    | Annotated[CallItem, Tag("function_call-item")]
    | Annotated[CallOutputItem, Tag("function_call_output-item")]
    | Annotated[ReasoningItem, Tag("reasoning-item")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an item is a message, function_call, function_call_output or reasoning",
    ),
]
Input = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("text-input")]
    | Annotated[Annotated[list[Item], Field(min_length=1)], Tag("item-list")],
    Discriminator(lambda v: "text-input" if isinstance(v, str) else "item-list"),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Inert


class ReasoningConfig(Strict):
    # accepted; a model reasons (in <think>) as its chat template says
    effort: Inert
    summary: Inert
    generate_summary: Inert


class ResponsesRequest(Strict):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    input: Input
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    store: bool = True
    stream: bool | None = None
    background: bool | None = None  # runs without its client; GET it, cancel it
    max_output_tokens: int | None = ranged("max_tokens")
    temperature: float | None = ranged("temperature")
    top_p: float | None = ranged("top_p")
    top_logprobs: int | None = ranged("logprobs")
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled", "auto"] | None = None  # no truncation here either way
    # vLLM's extensions, as on the chat route
    top_k: int | None = ranged("top_k")
    min_p: float | None = ranged("min_p")
    presence_penalty: float | None = ranged("presence_penalty")
    frequency_penalty: float | None = ranged("frequency_penalty")
    repetition_penalty: float | None = ranged("repetition_penalty")
    seed: int | None = ranged("seed")
    priority: int = ranged("priority", REQUEST_BOUNDS, 0)
    # OpenAI's, with no effect here (docs/protocol.md, "Fields with no effect")
    include: Inert
    max_tool_calls: Inert
    safety_identifier: Inert
    prompt_cache_key: Inert
    service_tier: Inert
    stream_options: Inert

    def tool_choice_json(self) -> Any:
        """`tool_choice` as a response echoes it."""
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedFunction) else (tc or "auto")


_items: TypeAdapter[list[Any]] = TypeAdapter(list[Item])


def validate_responses(raw: bytes, cfg: GatewayConfig) -> ResponsesRequest:
    """Parse and check a /v1/responses body (shape and the operator's limits)."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    return responses_request(obj, cfg)


def responses_request(obj: dict[str, Any], cfg: GatewayConfig) -> ResponsesRequest:
    """Check a parsed Responses body (also a WebSocket `responses` message's fields)."""
    items = obj.get("input")
    if isinstance(items, list) and len(items) > cfg.max_messages:  # before the schema's cost
        raise invalid("input", f"at most {cfg.max_messages} items (got {len(items)})")
    try:
        req = ResponsesRequest.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
    if req.max_output_tokens is not None and req.max_output_tokens > cfg.max_tokens_limit:
        raise invalid("max_output_tokens", f"at most {cfg.max_tokens_limit} (got {req.max_output_tokens})")
    if req.top_logprobs is not None and req.top_logprobs > cfg.max_top_logprobs:
        raise invalid("top_logprobs", f"at most {cfg.max_top_logprobs} (got {req.top_logprobs})")
    if req.background and (not req.store or req.stream):
        raise invalid(
            "background", "needs store (the default) and no stream: a background answer is read with GET"
        )
    names = [t.name for t in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.name", f"{name!r} is declared twice")
    tc = req.tool_choice
    if tc not in (None, "none", "auto") and not names:
        raise invalid("tool_choice", "needs `tools` (there is no function to call)")
    if isinstance(tc, NamedFunction) and tc.name not in names:
        raise invalid("tool_choice.name", f"{tc.name!r} is not one of the declared tools")
    return req


def turns(req: ResponsesRequest) -> list[Turn]:
    """The request's input in the kept shape; images and files are a 400 naming them."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    out: list[Turn] = []
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            out.append({"type": "message", "role": item.role, "content": _text(item.content, f"input.{i}")})
        elif isinstance(item, CallItem):
            out.append(item.model_dump(include={"type", "call_id", "name", "arguments"}))
        elif isinstance(item, CallOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"type": "function_call_output", "call_id": item.call_id, "output": text})
    return out


def _text(content: str | list[Any], at: str) -> str:
    if isinstance(content, str):
        return content
    for j, p in enumerate(content):
        if isinstance(p, OtherPart):
            raise invalid(f"{at}.content.{j}", f"{p.type} is not supported by this server: send text")
    return "".join(p.text for p in content)


def stored_turns(raw: Any) -> list[Turn]:
    """Turns read back from a stored response (written by `turns` and the renderer's
    `output_turns`); ValueError when they are not."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ValueError("a stored conversation must be a list of objects")
    _items.validate_python(raw)
    return raw


def chat_messages(items: list[Turn], instructions: str | None, first_new: int) -> list[dict[str, Any]]:
    """Chat messages of a conversation; `first_new` is the index of the request's own
    first item (those before came from `previous_response_id`), for 400s that name it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call id -> function name
    for i, t in enumerate(items):
        kind = t["type"]
        if kind == "message":
            messages.append({"role": t["role"], "content": t["content"]})
        elif kind == "function_call":
            call = {"id": t["call_id"], "type": "function"}
            call["function"] = {"name": t["name"], "arguments": t["arguments"]}
            names[t["call_id"]] = t["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            name = names.get(t["call_id"])
            if name is None:
                at = f"input.{i - first_new}.call_id" if i >= first_new else "previous_response_id"
                raise invalid(at, f"no function_call with call_id {t['call_id']!r} before this output")
            messages.append(
                {"role": "tool", "tool_call_id": t["call_id"], "name": name, "content": t["output"]}
            )
    return messages


def to_chat(
    req: ResponsesRequest, conversation: list[Turn], first_new: int, cfg: GatewayConfig
) -> ChatRequest:
    """The chat request that answers `req`, whose `conversation` is the turns of the
    responses it continues and then, from `first_new` on, its own input (`turns`)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(conversation, req.instructions, first_new),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "priority": req.priority,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.top_logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
        tc = req.tool_choice
        if isinstance(tc, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            body["tool_choice"] = tc
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise invalid("text.format.schema", 'required with "type": "json_schema"')
            rf["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = rf
    clean = {k: v for k, v in body.items() if v is not None}
    try:
        return validate_http(ChatRequest, orjson.dumps(clean), cfg)  # type: ignore[no-any-return]
    except APIError as e:
        raise renamed(e) from None


# Chat's field names as the Responses API names them, for 400s raised past translation;
# chat's `messages.N` is not the input's item N, so those name the `input` as a whole.
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
)


def renamed(e: APIError) -> APIError:
    """`e` with a chat field in its `param` (and message) given its Responses name."""
    p = e.param
    if p is not None and (p == "messages" or p.startswith("messages.")):
        e.param, e.message = "input", e.message.replace(p, "input", 1)
        return e
    for chat, ours in _RENAMES:
        if p is not None and (p == chat or p.startswith(chat + ".")):
            e.param = ours + p[len(chat) :]
            e.message = e.message.replace(chat, ours, 1)
            break
    return e
