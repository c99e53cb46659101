"""A Messages request as the chat request it means (`to_chat`: typed object to typed
object), so that a message goes through the same preparation, tool-call styles,
constraints and limits as a chat completion; a 400 the chat request finds is named by
the Messages field that made it (`_renamed`). It is part of validation: it reads
nothing but the request.

What it does: `system` becomes a system message; `text` blocks are the content; an
assistant's `tool_use` blocks become its tool calls (`input` as JSON arguments); each
`tool_result` block becomes a tool message, named by the call it answers; `thinking`
blocks an assistant sent back are not shown to the model (as `reasoning_content` on
chat); an `image` block (base64) is decoded and checked here, named by its block
(server/images.py), a URL or file source refused; documents are a 400; a final assistant turn
(Anthropic's prefill) is a 400 (the chat path would answer it with a new turn)."""

from __future__ import annotations

import re
from typing import Any

import orjson
from pydantic import ValidationError

from wsllm.config_gateway import GatewayConfig
from wsllm.server import images
from wsllm.server.api.messages.request import (
    UNREADABLE,
    AnyChoice,
    AutoChoice,
    Base64Source,
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    NamedChoice,
    NoneChoice,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    UnservedBlock,
)
from wsllm.server.constraints import JsonSchemaFormat, ResponseFormat
from wsllm.server.conversation import (
    CalledFunction,
    ChatMessage,
    ContentPart,
    FunctionDef,
    FunctionName,
    ImagePart,
    NamedToolChoice,
    TextPart,
    ToolCallIn,
    ToolDef,
    chat_message,
)
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import invalid
from wsllm.server.images import ImageLimits
from wsllm.server.schemas import ChatRequest, check_limits


def to_chat(req: CountTokensRequest, cfg: GatewayConfig) -> ChatRequest:
    """The chat request that `req` means, checked as a chat request is (the operator's
    limits, the conversation's rules); a 400 names the Messages field."""
    limits = ImageLimits.of(cfg)
    parts = [
        f"messages.{i}.content.{j}"
        for i, m in enumerate(req.messages)
        for j, b in enumerate(m.content if isinstance(m.content, list) else [])
        if isinstance(b, ImageBlock)
    ]
    images.check_count(parts, limits.per_request, "a request")
    messages, origin = _messages(req, limits)
    if len(messages) > cfg.max_messages:  # tool results are a message each
        raise invalid(
            "messages", f"at most {cfg.max_messages} messages, tool results counted (got {len(messages)})"
        )
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        fields["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        fields |= _tool_choice(req.tool_choice)
    if req.thinking is not None:  # Qwen3's switch; templates without it ignore it
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        schema = JsonSchemaFormat.model_validate({"name": "output", "schema": fmt.schema_})
        fields["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
    if isinstance(req, MessagesRequest):
        fields |= _sampling(req)
    try:
        chat = ChatRequest(**fields)
        check_limits(chat, cfg)
    except ValidationError as e:
        raise _renamed(from_validation(e), origin) from None
    except APIError as e:
        raise _renamed(e, origin) from None
    return chat


def _messages(req: CountTokensRequest, limits: ImageLimits) -> tuple[list[ChatMessage], list[int]]:
    """The chat messages, and for each the index of the Anthropic message it came from
    (-1: the system prompt)."""
    messages: list[ChatMessage] = []
    origin: list[int] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n\n".join(b.text for b in req.system)
        messages.append(chat_message("system", system))
        origin.append(-1)
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the results that answer it
    for i, m in enumerate(req.messages):
        converted = _assistant(m, i, names) if m.role == "assistant" else _user(m, i, names, limits)
        messages += converted
        origin += [i] * len(converted)
    if req.messages[-1].role == "assistant":
        at = f"messages.{len(req.messages) - 1}"
        raise invalid(
            f"{at}.role", "a final assistant turn (prefill) is not supported here; end with a user turn"
        )
    return messages, origin


def _sampling(req: MessagesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream}
    out |= {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    if req.metadata is not None and req.metadata.user_id is not None:
        out["user"] = req.metadata.user_id
    return out


def _tool(t: Tool) -> ToolDef:
    return ToolDef(
        type="function",
        function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema),
    )


def _tool_choice(c: AutoChoice | AnyChoice | NamedChoice | NoneChoice) -> dict[str, Any]:
    if isinstance(c, NoneChoice):
        return {"tool_choice": "none"}
    out: dict[str, Any]
    if isinstance(c, NamedChoice):
        out = {"tool_choice": NamedToolChoice(type="function", function=FunctionName(name=c.name))}
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
        if block.type in UNREADABLE:
            why = f"{block.type} blocks are not supported: this server reads text and images"
        else:
            why = f"{block.type} blocks are for Anthropic's server tools, which this server does not run"
        return invalid(f"{at}.type", why)
    return invalid(f"{at}.type", f"a {role} message cannot hold a {block.type} block")


def _user(m: Message, i: int, names: dict[str, str], limits: ImageLimits) -> list[ChatMessage]:
    """A user turn: its tool results as tool messages, its text and images as a user
    message, in the order they come (Anthropic puts the results first)."""
    out: list[ChatMessage] = []
    parts: list[ContentPart] = []

    def flush() -> None:
        if any(isinstance(p, ImagePart) for p in parts):
            out.append(chat_message("user", list(parts)))
        elif parts:
            out.append(chat_message("user", "".join(p.text for p in parts if isinstance(p, TextPart))))
        parts.clear()

    for j, b in enumerate(_blocks(m)):
        at = f"messages.{i}.content.{j}"
        if isinstance(b, TextBlock):
            parts.append(TextPart.model_construct(type="text", text=b.text))
        elif isinstance(b, ImageBlock):
            parts.append(ImagePart.of(_image(b, at, limits), at))
        elif isinstance(b, ToolResultBlock):
            flush()
            name = names.get(b.tool_use_id)
            out.append(chat_message("tool", b.text, tool_call_id=b.tool_use_id, name=name))
        else:
            raise _refuse(b, at, "user")
    flush()
    return out or [chat_message("user", "")]


def _image(b: ImageBlock, at: str, limits: ImageLimits) -> images.Image:
    """An image block's image, decoded and checked (a 400 naming the block)."""
    if not isinstance(b.source, Base64Source):
        why = "a URL source is not fetched by this server (a server-side request forgery)"
        if b.source.type == "file":
            why = "file sources are not supported here"
        raise invalid(f"{at}.source", f"{why}; send the image inline as a base64 source")
    return images.from_base64(b.source.data, b.source.media_type, at, limits)


def _assistant(m: Message, i: int, names: dict[str, str]) -> list[ChatMessage]:
    """An assistant turn: its text, and its tool_use blocks as tool calls; thinking
    it sent back is not shown to the model."""
    text: list[str] = []
    calls: list[ToolCallIn] = []
    for j, b in enumerate(_blocks(m)):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolUseBlock):
            names[b.id] = b.name
            fn = CalledFunction(name=b.name, arguments=orjson.dumps(b.input).decode())
            calls.append(ToolCallIn(id=b.id, type="function", function=fn))
        elif not isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            raise _refuse(b, f"messages.{i}.content.{j}", "assistant")
    content = "".join(text) if text or not calls else None
    return [chat_message("assistant", content, tool_calls=calls or None)]


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
