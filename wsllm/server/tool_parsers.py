"""Tool calls in model output, for the three common styles (torch-free):

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text before them being the answer's content;
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. The marker is a special token,
  which the detokenizer drops, so an output that *starts* with a JSON array of calls counts too.

One incremental machine per style: `feed(text)` takes a text delta and returns the content that is
settled and the calls that completed; `finish()` settles the rest. The whole-text parse is the same
machine fed once, so a stream split anywhere assembles to the same content and calls. A call is
emitted when its JSON is complete and valid: JSON that is broken, or not a call, is given back as
content, never raised. Whitespace next to a call (between calls, before one, after the last) is
dropped."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from wsllm.config import TOOL_PARSERS


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
    """What a piece of output turned into: content text and completed calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class _JsonScan:
    """Finds where the JSON object or array that starts a buffer ends, across feeds
    (it remembers how far it read): brackets are counted outside strings."""

    __slots__ = ("pos", "depth", "in_str", "esc")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pos = self.depth = 0
        self.in_str = self.esc = False

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
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
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


def _loads(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


class ToolStream:
    """The common part: content with its whitespace held until it is known not to
    touch a call, and calls built from parsed JSON."""

    #: keys that hold a call's arguments, in order of preference
    ARG_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, id_seed: str = "") -> None:
        self.seed = id_seed
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
        return Parsed(out.content + end.content, out.calls + end.calls)

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
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args: Any = next((obj[k] for k in self.ARG_KEYS if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _loads(args)
        if not isinstance(args, dict):
            return None
        call_id = self.call_id(len(self.calls) + offset)
        return ToolCall(call_id, obj["name"], json.dumps(args, ensure_ascii=False))

    def _emit(self, calls: list[ToolCall]) -> None:
        self._ws = ""
        self.calls += calls
        self._out.calls += calls


class HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, id_seed: str = "") -> None:
        super().__init__(id_seed)
        self._in_call = False
        self._from = 0  # where to look for CLOSE next

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if not self._in_call:
                i = buf.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else partial_suffix(buf, self.OPEN)
                    self._content(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                self._content(buf[:i])
                self._buf, self._in_call, self._from = buf[i + len(self.OPEN) :], True, 0
                continue
            j = buf.find(self.CLOSE, self._from)
            if j < 0:
                self._from = max(0, len(buf) - len(self.CLOSE) + 1)
                if final:  # no closing tag: a complete call still counts
                    self._close(buf, "")
                    self._buf = ""
                return
            self._close(buf[:j], self.CLOSE)
            self._buf, self._in_call = buf[j + len(self.CLOSE) :], False

    def _close(self, body: str, close: str) -> None:
        call = self._call(_loads(body.strip()))
        if call is None:
            self._content(self.OPEN + body + close)
        else:
            self._emit([call])


class Llama3JsonStream(ToolStream):
    TAG = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")

    def __init__(self, id_seed: str = "") -> None:
        super().__init__(id_seed)
        self._mode = "start"  # start -> json (calls) -> content (for good)
        self._sep = False  # a ';' came after the last call
        self._scan = _JsonScan()

    def _step(self, final: bool) -> None:
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG) :].lstrip()
            elif not final and (not head or self.TAG.startswith(head)):
                return
            if head.startswith("{"):
                self._mode, self._buf = "json", head
            elif head or final:
                self._mode = "content"
        if self._mode == "json":
            self._calls(final)
        if self._mode == "content":
            self._content(self._buf)
            self._buf = ""

    def _calls(self, final: bool) -> None:
        while True:
            buf = self._buf.lstrip()
            if not buf:
                self._buf = ""
                return
            if buf[0] == ";" and self.calls and not self._sep:
                self._buf, self._sep = buf[1:], True
                continue
            end = self._scan.end(buf) if buf[0] == "{" else -1
            self._buf = buf
            if end is None and not final:
                return
            call = self._call(_loads(buf[:end])) if end and end > 0 else None
            if call is None:  # broken or not a call: the rest is content
                self._mode = "content"
                return
            self._emit([call])
            self._buf, self._sep = buf[end:], False


class MistralStream(ToolStream):
    MARK = "[TOOL_CALLS]"

    def __init__(self, id_seed: str = "") -> None:
        super().__init__(id_seed)
        self._mode = "start"  # start | content | calls
        self._marked = False  # the calls came after the marker (else: a bare array at the start)
        self._scan = _JsonScan()

    def call_id(self, i: int) -> str:
        # Mistral's templates take only ids of 9 letters or digits.
        return hashlib.sha256(f"{self.seed}:{i}".encode()).hexdigest()[:9]

    def _step(self, final: bool) -> None:
        while True:
            if self._mode == "start" and not self._start(final):
                return
            if self._mode == "content":
                buf = self._buf
                i = buf.find(self.MARK)
                if i < 0:
                    keep = 0 if final else partial_suffix(buf, self.MARK)
                    self._content(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                self._content(buf[:i])
                self._buf, self._mode, self._marked = buf[i + len(self.MARK) :], "calls", True
            if self._mode == "calls" and not self._array(final):
                return

    def _start(self, final: bool) -> bool:
        """Decide whether the output opens with calls; False while it cannot tell."""
        head = self._buf.lstrip()
        after = head[1:].lstrip() if head.startswith("[") else None
        if head.startswith(self.MARK):
            self._buf, self._mode, self._marked = head[len(self.MARK) :], "calls", True
        elif after is not None and after.startswith("{"):
            self._buf, self._mode, self._marked = head, "calls", False
        elif not final and (not head or self.MARK.startswith(head) or after == ""):
            return False
        else:
            self._mode = "content"
        return True

    def _array(self, final: bool) -> bool:
        """Read the call array (or one call object) after the marker; False while it
        is still open."""
        buf = self._buf = self._buf.lstrip()
        if not buf and not final:
            return False
        end = self._scan.end(buf) if buf[:1] in ("[", "{") else None
        if end is None and not final and buf[:1] in ("[", "{"):
            return False
        value = _loads(buf[:end]) if end is not None else None
        items = value if isinstance(value, list) else [value]
        calls = [c for k, item in enumerate(items) if (c := self._call(item, k)) is not None]
        if items and len(calls) == len(items):
            self._emit(calls)
            self._buf = buf[end:]
        else:  # broken: the marker and the rest are content
            self._content((self.MARK if self._marked else "") + buf)
            self._buf = ""
        self._mode = "content"
        return True


_STREAMS: dict[str, type[ToolStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    "mistral": MistralStream,
}


assert set(_STREAMS) == set(TOOL_PARSERS), "a parser style without its stream, or the reverse"


def tool_stream(parser: str, id_seed: str = "") -> ToolStream:
    """A fresh incremental parser for the named style (one of TOOL_PARSERS)."""
    try:
        return _STREAMS[parser](id_seed)
    except KeyError:
        raise ValueError(f"unknown tool parser {parser!r}; one of {', '.join(TOOL_PARSERS)}") from None


def parse_tool_calls(parser: str, text: str, id_seed: str = "") -> Parsed:
    """The whole output at once: its content and its calls."""
    return tool_stream(parser, id_seed).parse(text)
