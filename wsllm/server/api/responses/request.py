"""The body of `POST /v1/responses` (OpenAI's Responses API) and of the WebSocket's
`responses` message: its shapes and every 400 they can name, with their Responses
field paths, at validation (before admission): the operator's limits, tools and
tool_choice, images (decoded and checked) and files, a `function_call_output` that answers no call of the
request (when it continues none). What a stored conversation decides (a call answered
by an earlier response) is told after admission, when it is loaded (translate.py);
what only the tokenizer can tell comes from preparation and is renamed there."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, TypeAdapter, ValidationError

from wsllm.bounds import MAX_ID_CHARS, REQUEST_BOUNDS
from wsllm.config_gateway import GatewayConfig
from wsllm.server import images
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid, ranged
from wsllm.server.images import ImageLimits
from wsllm.server.schemas import parse_json

_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
_ID = Field(max_length=MAX_ID_CHARS)


def _str_or_list(v: Any) -> str:
    return "text-content" if isinstance(v, str) else "part-list"


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Inert  # output_text sent back as it came
    logprobs: Inert


class InputImage(Strict):
    """An image: `image_url` a data: URL (server/images.py), decoded and checked while the
    request is validated; a `file_id` is refused (no files are stored here)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the size
    _image: images.Image | None = PrivateAttr(None)  # once checked

    @property
    def image(self) -> images.Image | None:
        """The checked image (after validation)."""
        return self._image


class OtherPart(Strict):
    """Files and audio: named, then refused with a 400 that says so."""

    type: Literal["input_file", "input_audio", "refusal"]
    model_config = {"extra": "allow"}


# Union tags that are not identifiers stay out of an error's `param` (errors.from_validation),
# so a 400 names the field as the client wrote it: `input.0.content.1.text`.
def _part_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if kind in ("input_text", "output_text"):
        return "text-part"
    return "image-part" if kind == "input_image" else "other-part"


Part = Annotated[
    Annotated[InputText, Tag("text-part")]
    | Annotated[InputImage, Tag("image-part")]
    | Annotated[OtherPart, Tag("other-part")],
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


ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[Item])


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
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
        raise invalid("text.format.schema", 'required with "type": "json_schema"')
    if fmt is not None and fmt.type != "text" and tc not in (None, "none", "auto"):
        raise invalid("tool_choice", "a forced call cannot be combined with text.format")
    _check_items(req)
    _check_images(req, ImageLimits.of(cfg))
    return req


def _check_items(req: ResponsesRequest) -> None:
    """What the items' schema cannot say: files are refused by name, and, in a request
    that continues no stored one, each call output answers a call before it."""
    if isinstance(req.input, str):
        return
    calls: set[str] = set()
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            for j, p in enumerate(item.content):
                if isinstance(p, OtherPart):
                    raise invalid(
                        f"input.{i}.content.{j}",
                        f"{p.type} is not supported by this server: send text or images",
                    )
        elif isinstance(item, CallItem):
            calls.add(item.call_id)
        elif (
            isinstance(item, CallOutputItem)
            and item.call_id not in calls
            and req.previous_response_id is None
        ):
            raise invalid(
                f"input.{i}.call_id", f"no function_call with call_id {item.call_id!r} before this output"
            )


def image_parts(req: ResponsesRequest) -> list[tuple[str, InputImage]]:
    """The request's own images, each with the part it is (`input.I.content.J`)."""
    if isinstance(req.input, str):
        return []
    return [
        (f"input.{i}.content.{j}", p)
        for i, item in enumerate(req.input)
        if isinstance(item, MessageItem) and not isinstance(item.content, str)
        for j, p in enumerate(item.content)
        if isinstance(p, InputImage)
    ]


def _check_images(req: ResponsesRequest, limits: ImageLimits) -> None:
    """Its images: at most `limits.per_request`, each a data: URL that decodes within the
    limits (a 400 naming the part); the translation takes them as they are (translate.py)."""
    parts = image_parts(req)
    images.check_count([at for at, _ in parts], limits.per_request, "a request")
    for at, p in parts:
        if p.image_url is None:
            why = (
                "file_id is not supported here (no files are stored)"
                if p.file_id
                else "image_url is required"
            )
            raise invalid(at, f"{why}; send image_url as a data: URL")
        p._image = images.from_url(p.image_url, at, limits)
