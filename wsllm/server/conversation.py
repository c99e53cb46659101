"""A chat's conversation as a client sends it: messages, tools and tool_choice, their
shapes (pydantic, strict) and what those shapes cannot say (`check_conversation`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Discriminator, Field, Tag

from wsllm.bounds import MAX_ID_CHARS
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


def chat_message(
    role: str,
    content: str | None,
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
) -> None:
    """What the schema cannot say about messages, tools and tool_choice (`forced`: the
    function a tool_choice forces, "" for "required", None otherwise)."""
    for i, m in enumerate(messages):
        m.check(i)
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
