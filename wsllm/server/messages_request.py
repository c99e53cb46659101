"""Anthropic's Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`):
its shapes (pydantic, strict, unknown fields a 400 as on every route) and its
translation into the chat request that the rest of the gateway already serves
(`to_chat`), so that a message goes through the same preparation, tool-call styles,
constraints and limits as a chat completion. The answer's shapes are messages_api.py.

What the translation does: `system` becomes a system message; `text` blocks are the
content; an assistant's `tool_use` blocks become its tool calls (`input` as JSON
arguments); each `tool_result` block becomes a tool message, named by the call it
answers; `thinking` blocks an assistant sent back are not shown to the model (as
`reasoning_content` on chat); images and documents are a 400 (text models here)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wsllm.bounds import MAX_ID_CHARS
from wsllm.config_gateway import GatewayConfig
from wsllm.server import textwork
from wsllm.server.conversation import MAX_TOOLS
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import Inert, Strict, invalid, ranged
from wsllm.server.schemas import ChatRequest, parse_json, validate_http

# Bodies larger than this are validated off the event loop (as on the OpenAI routes).
_VALIDATE_INLINE_BYTES = 64 * 1024
# Block types Anthropic takes that a text model served here cannot read.
_UNREADABLE = ("image", "document", "search_result", "container_upload")
# Blocks of Anthropic's server-side tools: they run on Anthropic's servers only.
_SERVER_SIDE = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "mcp_tool_use")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: Inert  # prompt caching is automatic here (prefix cache)
    citations: Inert


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
    type: Literal[_UNREADABLE + _SERVER_SIDE]  # type: ignore[valid-type]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | UnservedBlock,
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


class MessagesRequest(CountTokensRequest):
    max_tokens: int = ranged("max_tokens", default=...)  # required, as Anthropic's
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = ranged("temperature")
    top_p: float | None = ranged("top_p")
    top_k: int | None = ranged("top_k")
    metadata: Metadata | None = None
    service_tier: Inert  # one tier here


def validate_body(raw: bytes, cfg: GatewayConfig, model: type[CountTokensRequest]) -> ChatRequest:
    """A Messages (or count_tokens) body, checked, as the chat request it means: every
    400 that needs no tokenizer, named by the Anthropic field."""
    obj = parse_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "invalid_request", "the body must be a JSON object")
    messages = obj.get("messages")
    if isinstance(messages, list) and len(messages) > cfg.max_messages:
        raise invalid("messages", f"at most {cfg.max_messages} messages (got {len(messages)})")
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        raise from_validation(e) from None
    body, origin = chat_body(req)
    try:
        return validate_http(ChatRequest, orjson.dumps(body), cfg)  # type: ignore[no-any-return]
    except APIError as e:
        raise _renamed(e, origin) from None


async def validate(raw: bytes, cfg: GatewayConfig, model: type[CountTokensRequest]) -> ChatRequest:
    if len(raw) <= _VALIDATE_INLINE_BYTES:
        return validate_body(raw, cfg, model)
    return await textwork.run(validate_body, raw, cfg, model)  # a large body must not hold the loop


def chat_body(req: CountTokensRequest) -> tuple[dict[str, Any], list[int]]:
    """The chat request body that `req` means, and for each of its messages the index of
    the Anthropic message it came from (-1: the system prompt)."""
    messages: list[dict[str, Any]] = []
    origin: list[int] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
        origin.append(-1)
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the results that answer it
    for i, m in enumerate(req.messages):
        converted = _assistant(m, i, names) if m.role == "assistant" else _user(m, i, names)
        messages += converted
        origin += [i] * len(converted)
    if req.messages[-1].role == "assistant":
        # Anthropic continues a final assistant turn (prefill); the chat path here would
        # answer it with a new turn instead, so say so rather than answer otherwise.
        at = f"messages.{len(req.messages) - 1}"
        raise invalid(
            f"{at}.role", "a final assistant turn (prefill) is not supported here; end with a user turn"
        )
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body |= _tool_choice(req.tool_choice)
    if req.thinking is not None:  # Qwen3's switch; templates without it ignore it
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_},
        }
    if isinstance(req, MessagesRequest):
        body |= _sampling(req)
    return body, origin


def _sampling(req: MessagesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": req.max_tokens}
    fields = (
        ("stop", req.stop_sequences),
        ("stream", req.stream),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    )
    out |= {k: v for k, v in fields if v is not None}
    if req.top_k is not None:
        out["top_k"] = req.top_k
    if req.metadata is not None and req.metadata.user_id is not None:
        out["user"] = req.metadata.user_id
    return out


def _tool(t: Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _tool_choice(c: AutoChoice | AnyChoice | NamedChoice | NoneChoice) -> dict[str, Any]:
    out: dict[str, Any]
    if isinstance(c, NoneChoice):
        return {"tool_choice": "none"}
    if isinstance(c, NamedChoice):
        out = {"tool_choice": {"type": "function", "function": {"name": c.name}}}
    else:
        out = {"tool_choice": "required" if isinstance(c, AnyChoice) else "auto"}
    if c.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _blocks(m: Message) -> list[Any]:
    return (
        [TextBlock.model_construct(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    )


def _refuse(block: Any, at: str, role: str) -> APIError:
    if isinstance(block, UnservedBlock):
        if block.type in _UNREADABLE:
            why = f"{block.type} blocks are not supported: this server's models read text only"
        else:
            why = f"{block.type} blocks are for Anthropic's server tools, which this server does not run"
        return invalid(f"{at}.type", why)
    return invalid(f"{at}.type", f"a {role} message cannot hold a {block.type} block")


def _user(m: Message, i: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages, its text as a user message, in
    the order they come (Anthropic puts the results first)."""
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for j, b in enumerate(_blocks(m)):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolResultBlock):
            flush()
            tool = {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
            out.append(tool | ({"name": names[b.tool_use_id]} if b.tool_use_id in names else {}))
        else:
            raise _refuse(b, f"messages.{i}.content.{j}", "user")
    flush()
    return out or [{"role": "user", "content": ""}]


def _assistant(m: Message, i: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant turn: its text, and its tool_use blocks as tool calls; thinking
    it sent back is not shown to the model."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(_blocks(m)):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolUseBlock):
            names[b.id] = b.name
            arguments = orjson.dumps(b.input).decode()
            calls.append(
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}
            )
        elif not isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            raise _refuse(b, f"messages.{i}.content.{j}", "assistant")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    return [out | ({"tool_calls": calls} if calls else {})]


# Chat field names in a 400 -> the Messages field that was sent.
_RENAMES = {
    "stop": "stop_sequences",
    "tool_choice.function.name": "tool_choice.name",
    "user": "metadata.user_id",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
}
_MESSAGE_PARAM = re.compile(r"^messages\.(\d+)(\.|$)")


def _renamed(e: APIError, origin: list[int]) -> APIError:
    """A 400 of the chat request, named by the Messages fields that made it."""
    old = e.param
    if old is None:
        return e
    new = _RENAMES.get(old, old)
    hit = _MESSAGE_PARAM.match(old)
    if hit and int(hit.group(1)) < len(origin):
        at = origin[int(hit.group(1))]
        new = "system" if at < 0 else f"messages.{at}"
    if new != old:
        e.param = new
        e.message = e.message.replace(old, new, 1)
    return e
