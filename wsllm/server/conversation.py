"""A chat's conversation as a client sends it: messages, tools and tool_choice, their
shapes (pydantic, strict) and what those shapes cannot say (`check_conversation`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Discriminator, Field, PrivateAttr, Tag

from wsllm.bounds import MAX_ID_CHARS
from wsllm.server import images
from wsllm.server.fields import Inert, Strict, invalid

# Tools in one request, and tool calls in one message.
MAX_TOOLS = 128
# apply_chat_template's own arguments: not for chat_template_kwargs to set.
TEMPLATE_RESERVED = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageUrl(Strict):
    url: str  # a data: URL (server/images.py); http(s) is refused
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the size


class ImagePart(Strict):
    """OpenAI's `image_url` part: decoded and checked with the conversation
    (`check_conversation`). Another API's image becomes one, decoded already (`of`)."""

    type: Literal["image_url"]
    image_url: ImageUrl
    _image: images.Image | None = PrivateAttr(None)
    _where: str = PrivateAttr("")  # the part as its client's API names it, for a later 400

    @classmethod
    def of(cls, image: images.Image, where: str) -> ImagePart:
        """The part of an image another API's request carried, checked there."""
        part = cls.model_construct(type="image_url", image_url=ImageUrl.model_construct(url="", detail=None))
        part._image, part._where = image, where
        return part

    @property
    def image(self) -> images.Image:
        """The checked image (after `check_conversation`)."""
        if self._image is None:
            raise ValueError("an image part is read only once its conversation is checked")
        return self._image

    @property
    def where(self) -> str:
        return self._where

    def decode(self, at: str, limits: images.ImageLimits) -> None:
        """Decode and check its image (a 400 naming `at`), unless it was already."""
        if self._image is None:
            self._image, self._where = images.from_url(self.image_url.url, at, limits), at


def _part_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "image-part" if kind == "image_url" else "text-part"


# A text or an image; a 400 names the part as the client wrote it (tags that are not
# identifiers stay out of its `param`).
ContentPart = Annotated[
    Annotated[TextPart, Tag("text-part")] | Annotated[ImagePart, Tag("image-part")],
    Discriminator(_part_kind),
]


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
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


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(Strict):
    """A call of an earlier assistant turn, sent back in `messages`."""

    id: str = Field(max_length=MAX_ID_CHARS)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only on an assistant message that made tool calls (checked by `check`)
    content: str | list[ContentPart] | None = None
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
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """Its image parts, each with its index in `content`."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

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

    def check(self, i: int) -> None:
        """What the schema cannot say about message `i`: which role takes which field."""
        at = f"messages.{i}"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise invalid(f"{at}.content", f"required for a {self.role} message (null only with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid(f"{at}.tool_calls", "only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid(f"{at}.tool_call_id", "required for a tool message (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise invalid(f"{at}.tool_call_id", "only a tool message has tool_call_id")
        if self.role != "user" and self.image_parts:
            raise invalid(f"{at}.content.{self.image_parts[0][0]}", "only a user message can hold an image")


def chat_message(
    role: str,
    content: str | list[ContentPart] | None,
    *,
    name: str | None = None,
    tool_calls: list[ToolCallIn] | None = None,
    tool_call_id: str | None = None,
) -> ChatMessage:
    """A message another API's request translates into (Messages, Responses): checked
    as a client's would be."""
    fields = {"role": role, "content": content, "name": name, "tool_calls": tool_calls}
    return ChatMessage.model_validate(fields | {"tool_call_id": tool_call_id})


def _template_call(c: ToolCallIn) -> dict[str, Any]:
    # Chat templates expect the arguments as a mapping (they write them with `tojson`).
    try:
        args: Any = orjson.loads(c.function.arguments)
    except orjson.JSONDecodeError:
        args = c.function.arguments
    return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}


def check_conversation(
    messages: list[ChatMessage],
    tools: list[ToolDef] | None,
    forced: str | None,
    template_kwargs: dict[str, Any] | None,
    limits: images.ImageLimits,
) -> None:
    """What the schema cannot say about messages, tools and tool_choice (`forced`: the
    function a tool_choice forces, "" for "required", None otherwise); each image decoded
    and checked against `limits`."""
    for i, m in enumerate(messages):
        m.check(i)
    check_images(messages, limits)
    names = [t.function.name for t in tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.function.name", f"{name!r} is declared twice")
    if forced is not None and not names:
        raise invalid("tool_choice", "needs `tools` (there is no function to call)")
    if forced and forced not in names:
        raise invalid("tool_choice.function.name", f"{forced!r} is not one of the declared tools")
    for key in template_kwargs or {}:
        if key in TEMPLATE_RESERVED:
            raise invalid(f"chat_template_kwargs.{key}", "is set by the server; use the request's own field")


def check_images(messages: list[ChatMessage], limits: images.ImageLimits) -> None:
    """The conversation's images: at most `limits.per_conversation` of them, each decoded
    and checked (server/images.py) unless another API's request did it already; a 400
    names the part."""
    parts = [(f"messages.{i}.content.{j}", p) for i, m in enumerate(messages) for j, p in m.image_parts]
    if not parts:
        return
    images.check_count([at for at, _ in parts], limits.per_conversation, "a conversation")
    for at, p in parts:
        p.decode(at, limits)


def check_request_images(messages: list[ChatMessage], limits: images.ImageLimits) -> None:
    """At most `limits.per_request` images in a request's own messages (a chat's body),
    counted before any is decoded."""
    parts = [f"messages.{i}.content.{j}" for i, m in enumerate(messages) for j, _ in m.image_parts]
    images.check_count(parts, limits.per_request, "a request")
