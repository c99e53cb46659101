"""Tool calls in model output, what every style's reader shares (torch-free).

One incremental machine per style (chat/styles/): `feed(text)` takes a text delta and
returns the content that is settled and the calls that completed; `finish()` settles the
rest. The whole-text parse is the same machine fed once, so a stream split anywhere
assembles to the same content and calls. A call is emitted when it is complete and
valid: a call that is broken, or not a call, is given back as content, never raised. Whitespace next to a call (between calls, before one, after the last) is
dropped."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class Parsed:
    """What a piece of output turned into: content text and completed calls (and the
    reasoning, from a style that reads the whole answer: ToolStyle.WHOLE_ANSWER)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""


class BracketScan:
    """Finds where the bracketed value that starts a buffer ends, across feeds (it
    remembers how far it read): brackets are counted outside strings, which open and
    close with one of `quotes` (JSON: `"`; Python: both quotes)."""

    __slots__ = ("quotes", "pos", "depth", "in_str", "esc")

    def __init__(self, quotes: str = '"') -> None:
        self.quotes = quotes
        self.reset()

    def reset(self) -> None:
        self.pos = self.depth = 0
        self.in_str = ""  # the quote of the open string; "" outside strings
        self.esc = False

    def end(self, buf: str) -> int | None:
        """Index just past the value that starts at buf[0] ('{' or '['); None while open."""
        depth, in_str, esc = self.depth, self.in_str, self.esc
        for i in range(self.pos, len(buf)):
            ch = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == in_str:
                    in_str = ""
            elif ch in self.quotes:
                in_str = ch
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth <= 0:
                    self.reset()
                    return i + 1
        self.pos, self.depth, self.in_str, self.esc = len(buf), depth, in_str, esc
        return None


def partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def loads(text: str) -> Any:
    """Parsed JSON, or None when `text` is not JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


class ToolStream:
    """The common part: content with its whitespace held until it is known not to
    touch a call, and calls built from a name and arguments. A style's stream
    implements `_step`; `arg_types` are its style's `ToolStyle.arg_types` of the
    offered tools (most styles need none)."""

    #: keys that hold a call's arguments, in order of preference
    ARG_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        self.seed = id_seed
        self.arg_types = arg_types or {}
        self.calls: list[ToolCall] = []  # every call so far
        self._buf = ""
        self._ws = ""  # trailing whitespace of the content, held
        self._out = Parsed()

    def feed(self, text: str) -> Parsed:
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> Parsed:
        self._step(final=True)
        if not self.calls:
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    def parse(self, text: str) -> Parsed:
        """The whole output at once (a fresh stream)."""
        out = self.feed(text)
        end = self.finish()
        return Parsed(out.content + end.content, out.calls + end.calls, out.reasoning + end.reasoning)

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        return out

    def _content(self, text: str) -> None:
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        self._out.content += self._ws + body
        self._ws = text[len(body) :]

    def call_id(self, i: int) -> str:
        # Deterministic (a replay after a resume gives the same ids), unique per request.
        return "call_" + hashlib.sha256(f"{self.seed}:{i}".encode()).hexdigest()[:24]

    def _call(self, obj: Any, offset: int = 0) -> ToolCall | None:
        """A call from one parsed JSON object (the `offset`-th of those not yet
        emitted); None when it is not one."""
        if not isinstance(obj, dict):
            return None
        args: Any = next((obj[k] for k in self.ARG_KEYS if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = loads(args)
        return self._make(obj.get("name"), args, offset)

    def _make(self, name: Any, args: Any, offset: int = 0) -> ToolCall | None:
        """The call of `name` with `args` (the `offset`-th of those not yet emitted);
        None when they are not a name and an arguments object."""
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        call_id = self.call_id(len(self.calls) + offset)
        return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))

    def _emit(self, calls: list[ToolCall]) -> None:
        self._ws = ""
        self.calls += calls
        self._out.calls += calls
