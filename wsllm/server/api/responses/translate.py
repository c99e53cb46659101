"""A Responses request as the chat request every other route prepares (`to_chat`:
typed object to typed object): `instructions` become a system message, input items
become messages (a `function_call` joins the assistant turn before it, a
`function_call_output` is a tool message), function tools and `tool_choice` take chat's
shapes, and `text.format` becomes `response_format`. It runs after admission: a
request may continue a stored conversation (`previous_response_id`), loaded then.

Items are kept between turns in one plain shape (`Turn`: a dict per message, call or
call output; reasoning is not shown to the model again, as with chat's
`reasoning_content`) (a message with images keeps its parts, each image as its
data URL), which is also what a stored response keeps for
`previous_response_id`. A 400 the chat request finds is given its Responses name
(`renamed`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from wsllm.config_gateway import GatewayConfig
from wsllm.server.api.responses.request import (
    ITEMS,
    CallItem,
    CallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
    image_parts,
)
from wsllm.server.constraints import JsonSchemaFormat, ResponseFormat
from wsllm.server.conversation import (
    CalledFunction,
    ChatMessage,
    ContentPart,
    FunctionDef,
    FunctionName,
    ImagePart,
    ImageUrl,
    NamedToolChoice,
    TextPart,
    ToolCallIn,
    ToolDef,
    chat_message,
)
from wsllm.server.errors import APIError, from_validation
from wsllm.server.fields import invalid
from wsllm.server.images import Image
from wsllm.server.schemas import ChatRequest, check_limits

#: an item of a conversation in its kept shape (see the module's docstring)
Turn = dict[str, Any]


def turns(req: ResponsesRequest) -> list[Turn]:
    """The request's input in the kept shape (validation refused files)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    out: list[Turn] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append({"type": "message", "role": item.role, "content": _kept_content(item.content)})
        elif isinstance(item, CallItem):
            out.append(item.model_dump(include={"type", "call_id", "name", "arguments"}))
        elif isinstance(item, CallOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"type": "function_call_output", "call_id": item.call_id, "output": text})
    return out


def _kept_content(c: str | list[Any]) -> str | list[dict[str, Any]]:
    """A message's content as kept: its text, or with images its parts (text and data
    URLs; validation refused the others)."""
    if isinstance(c, str):
        return c
    if not any(isinstance(p, InputImage) for p in c):
        return "".join(p.text for p in c if isinstance(p, InputText))
    return [
        {"type": "input_text", "text": p.text}
        if isinstance(p, InputText)
        else {"type": "input_image", "image_url": p.image_url}
        for p in c
        if isinstance(p, InputText | InputImage)
    ]


def checked_images(req: ResponsesRequest) -> dict[str, tuple[Image, str]]:
    """The request's own images as validation checked them, by their data URL, with the
    part each is: the translation takes them as they are."""
    return {p.image_url: (p.image, at) for at, p in image_parts(req) if p.image_url and p.image}


def stored_turns(raw: Any) -> list[Turn]:
    """Turns read back from a stored response (written by `turns` and the renderer's
    `output_turns`); ValueError when they are not."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ValueError("a stored conversation must be a list of objects")
    ITEMS.validate_python(raw)
    return raw


@dataclass(slots=True)
class _Turn:
    """A chat message being made (an assistant turn gathers its calls)."""

    role: str
    content: str | list[ContentPart] | None
    calls: list[ToolCallIn] = field(default_factory=list)
    call_id: str | None = None
    name: str | None = None

    def message(self) -> ChatMessage:
        return chat_message(
            self.role, self.content, tool_calls=self.calls or None, tool_call_id=self.call_id, name=self.name
        )


def chat_messages(
    items: list[Turn],
    instructions: str | None,
    first_new: int,
    checked: dict[str, tuple[Image, str]] | None = None,
) -> list[ChatMessage]:
    """Chat messages of a conversation; `first_new` is the index of the request's own
    first item (those before came from `previous_response_id`), for 400s that name it;
    `checked`: the request's own images, decoded already (`checked_images`)."""
    out: list[_Turn] = [_Turn("system", instructions)] if instructions else []
    names: dict[str, str] = {}  # call id -> function name
    for i, t in enumerate(items):
        kind = t["type"]
        if kind == "message":
            out.append(_Turn(t["role"], _chat_content(t["content"], checked or {})))
        elif kind == "function_call":
            names[t["call_id"]] = t["name"]
            call = ToolCallIn(
                id=t["call_id"],
                type="function",
                function=CalledFunction(name=t["name"], arguments=t["arguments"]),
            )
            if not out or out[-1].role != "assistant":  # else the same turn's calls
                out.append(_Turn("assistant", None))
            out[-1].calls.append(call)
        elif kind == "function_call_output":
            name = names.get(t["call_id"])
            if name is None:
                at = f"input.{i - first_new}.call_id" if i >= first_new else "previous_response_id"
                raise invalid(at, f"no function_call with call_id {t['call_id']!r} before this output")
            out.append(_Turn("tool", t["output"], call_id=t["call_id"], name=name))
    return [t.message() for t in out]


def _chat_content(kept: str | list[dict[str, Any]], checked: dict[str, tuple[Image, str]]) -> Any:
    """A kept message's content as chat's: its text, or its text and image parts (an image
    of a stored conversation is decoded again by the chat's check)."""
    if isinstance(kept, str):
        return kept
    parts: list[ContentPart] = []
    for p in kept:
        if p["type"] == "input_text":
            parts.append(TextPart.model_construct(type="text", text=p["text"]))
        elif p["image_url"] in checked:
            parts.append(ImagePart.of(*checked[p["image_url"]]))
        else:
            url = ImageUrl.model_construct(url=p["image_url"], detail=None)
            parts.append(ImagePart.model_construct(type="image_url", image_url=url))
    return parts


def to_chat(
    req: ResponsesRequest, conversation: list[Turn], first_new: int, cfg: GatewayConfig
) -> ChatRequest:
    """The chat request that answers `req`, whose `conversation` is the turns of the
    responses it continues and then, from `first_new` on, its own input (`turns`)."""
    fields: dict[str, Any] = {
        "model": req.model,
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
        fields |= {"logprobs": True, "top_logprobs": req.top_logprobs}
    if req.tools:
        fields["tools"] = [
            ToolDef(type="function", function=FunctionDef(**t.model_dump(exclude={"type"})))
            for t in req.tools
        ]
        tc = req.tool_choice
        if isinstance(tc, NamedFunction):
            fields["tool_choice"] = NamedToolChoice(type="function", function=FunctionName(name=tc.name))
        else:
            fields["tool_choice"] = tc
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        schema = None
        if fmt.type == "json_schema":  # its schema is there: validation said so
            schema = JsonSchemaFormat.model_validate(
                {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            )
        fields["response_format"] = ResponseFormat(type=fmt.type, json_schema=schema)
    try:
        messages = chat_messages(conversation, req.instructions, first_new, checked_images(req))
        chat = ChatRequest(messages=messages, **fields)
        check_limits(chat, cfg)
    except ValidationError as e:
        raise renamed(from_validation(e)) from None
    except APIError as e:
        raise renamed(e) from None
    return chat


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
