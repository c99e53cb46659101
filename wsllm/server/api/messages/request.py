"""Anthropic's Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`):
its shapes (pydantic, strict, unknown fields a 400 as on every route). Its translation
into the chat request the rest of the gateway serves is translate.py; the answer's
shapes are render.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wsllm.bounds import MAX_ID_CHARS
from wsllm.config_gateway import GatewayConfig
from wsllm.server.conversation import MAX_TOOLS
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid, ranged
from wsllm.server.schemas import parse_json

# Block types Anthropic takes that no model served here can read.
UNREADABLE = ("document", "search_result", "container_upload")
# Blocks of Anthropic's server-side tools: they run on Anthropic's servers only.
_SERVER_SIDE = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "mcp_tool_use")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: Inert  # prompt caching is automatic here (prefix cache)
    citations: Inert


class Base64Source(Strict):
    type: Literal["base64"]
    media_type: str  # checked with the image (server/images.py): PNG, JPEG, WebP or GIF
    data: str


class OtherSource(BaseModel):
    """A URL or an uploaded file: accepted by the schema so that the 400 can say why."""

    model_config = ConfigDict(extra="allow")
    type: Literal["url", "file"]


class ImageBlock(Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | OtherSource, Field(discriminator="type")]
    cache_control: Inert


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(max_length=MAX_ID_CHARS)
    name: str = Field(max_length=64)
    input: dict[str, Any]
    cache_control: Inert


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=MAX_ID_CHARS)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: Inert

    @property
    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        # The model is told a failed call failed: the flag has no other way into a template.
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class UnservedBlock(BaseModel):
    """A block this server cannot serve: accepted by the schema so that the 400 can say
    why, rather than that its type is unknown."""

    model_config = ConfigDict(extra="allow")
    type: Literal[UNREADABLE + _SERVER_SIDE]  # type: ignore[valid-type]


Block = Annotated[
    TextBlock
    | ImageBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | UnservedBlock,
    Field(discriminator="type"),
]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    type: Literal["custom"] | None = None  # a client tool; Anthropic's server tools are not served
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Inert


class AutoChoice(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class AnyChoice(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class NamedChoice(Strict):
    type: Literal["tool"]
    name: str = Field(max_length=64)
    disable_parallel_tool_use: bool | None = None


class NoneChoice(Strict):
    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoneChoice, Field(discriminator="type")]


class ThinkingOn(Strict):
    type: Literal["enabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # accepted; the model decides how long it thinks
    display: Inert  # the thinking is always shown here


class ThinkingOff(Strict):
    type: Literal["disabled"]


class JsonOutput(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutput | None = None  # structured output, through the chat's response_format
    effort: Inert  # one effort here


class Metadata(Strict):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(Strict):
    """`/v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: str = Field(max_length=MAX_ID_CHARS)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingOn | ThinkingOff, Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    cache_control: Inert  # prompt caching is automatic here (prefix cache)


R = TypeVar("R", bound=CountTokensRequest)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = ranged("max_tokens", default=...)  # required, as Anthropic's
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = ranged("temperature")
    top_p: float | None = ranged("top_p")
    top_k: int | None = ranged("top_k")
    metadata: Metadata | None = None
    service_tier: Inert  # one tier here


def parsed(raw: bytes, cfg: GatewayConfig, model: type[R]) -> R:
    """A Messages (or count_tokens) body in its own shape: every 400 of that shape, named
    by the Anthropic field (translate.py then makes it the chat request it means)."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    messages = obj.get("messages")
    if isinstance(messages, list) and len(messages) > cfg.max_messages:  # before the schema's cost
        raise invalid("messages", f"at most {cfg.max_messages} messages (got {len(messages)})")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
