"""What a chat answer's text becomes, per choice: the `<think>` block split off as
reasoning (reasoning.py), then tool calls parsed out of the rest by the request's
tool-call style (styles/, by name from registry.py); a style that reads the whole
answer (harmony's channels) gives the reasoning too, and no `<think>` splitter runs.

`ChoiceOutput.feed(text, final)` takes the text after stop strings and returns a
`Piece`: content, reasoning and OpenAI-shaped `tool_calls` deltas. A call goes out as
two deltas, when it is complete: the first with its `index`, `id`, `type` and
function `name` (`arguments` ""), the second with the `arguments`. A client that
appends `arguments` per `index` (the OpenAI SDK, LangChain) gets the same calls as the
answer that was not streamed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wsllm.server.chat.calls import ToolCall, ToolStream
from wsllm.server.chat.reasoning import ThinkSplitter
from wsllm.server.chat.registry import STYLES, get_style
from wsllm.types import FINISH_STOP

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(slots=True, frozen=True)
class OutputOptions:
    """How a request's chat output is read; kept in the request's context so that a
    gateway that resumes it reads it the same way."""

    #: parse tool calls in this style (a name in registry.STYLES); None: no tools were offered
    tool_parser: str | None = None
    #: split a leading `<think>…</think>` into reasoning
    reasoning: bool = True
    #: what the style needs to know of the offered tools to read calls (ToolStyle.arg_types)
    arg_types: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in STYLES:
            raise ValueError(f"unknown tool parser {self.tool_parser!r}")

    @property
    def whole_answer(self) -> bool:
        """The style reads the whole answer from text with its special tokens (ToolStyle.WHOLE_ANSWER)."""
        return self.tool_parser is not None and STYLES[self.tool_parser].WHOLE_ANSWER

    def to_context(self) -> dict[str, Any]:
        ctx: dict[str, Any] = {"tool_parser": self.tool_parser, "reasoning": self.reasoning}
        return ctx | ({"arg_types": self.arg_types} if self.arg_types else {})

    @classmethod
    def from_context(cls, ctx: Any) -> OutputOptions | None:
        if not isinstance(ctx, dict):
            return None
        parser = ctx.get("tool_parser")
        types = ctx.get("arg_types")
        return cls(
            parser if isinstance(parser, str) else None,
            bool(ctx.get("reasoning", True)),
            types if isinstance(types, dict) else {},
        )


@dataclass(slots=True)
class Piece:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """The streamed deltas of the `index`-th call of a choice."""
    return [
        {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def assemble_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole calls from streamed deltas, as a client assembles them (by `index`,
    `arguments` appended)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        c = calls.setdefault(
            d["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        c["id"] = d.get("id") or c["id"]
        fn = d.get("function") or {}
        c["function"]["name"] = fn.get("name") or c["function"]["name"]
        c["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


class ChoiceOutput:
    """One choice's text, split into reasoning, content and tool calls."""

    __slots__ = ("_think", "_tools", "num_calls")

    def __init__(self, opts: OutputOptions, id_seed: str, in_think: bool = False) -> None:
        self._think = ThinkSplitter(in_think) if opts.reasoning and not opts.whole_answer else None
        self._tools: ToolStream | None = (
            get_style(opts.tool_parser).stream(id_seed, opts.arg_types) if opts.tool_parser else None
        )
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> Piece:
        """The next piece of the choice's text; `final` on its last (flushes what was
        held back)."""
        reasoning, content = "", text
        if self._think is not None:
            reasoning, content = self._think.feed(text)
            if final:
                r, c = self._think.finish()
                reasoning, content = reasoning + r, content + c
        if self._tools is None:
            return Piece(content, reasoning)
        parsed = self._tools.feed(content)
        if final:
            end = self._tools.finish()
            parsed.content += end.content
            parsed.calls += end.calls
            parsed.reasoning += end.reasoning
        deltas = []
        for call in parsed.calls:
            deltas += call_deltas(self.num_calls, call)
            self.num_calls += 1
        return Piece(parsed.content, reasoning + parsed.reasoning, deltas)

    def finish_reason(self, engine_reason: str) -> str:
        """What the client is told: `tool_calls` when the choice ended on its own
        (not cut by `length`) after making calls."""
        return FINISH_TOOL_CALLS if self.num_calls and engine_reason == FINISH_STOP else engine_reason
