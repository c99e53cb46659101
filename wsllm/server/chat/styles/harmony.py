"""gpt-oss's harmony format: the answer is messages, each a header, `<|message|>`, a body
and an end (`<|end|>`; `<|return|>` or `<|call|>` stop the turn), the next opened by
`<|start|>` (the prompt opens the first, `<|start|>assistant`):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

A header names the channel after `<|channel|>` and the recipient as `to=...` (before or
after the channel), maybe a content type (`<|constrain|>json`). What each body becomes:

- a message to `functions.NAME` (channel commentary, as trained): a call of NAME, whose body
  is its arguments object (JSON); a body that is no JSON object is content;
- channel `analysis`: reasoning (`reasoning_content`, the Messages API's thinking);
- channel `final`, and `commentary` without a recipient (a preamble to the user): content;
- anything else: content. So is a header that is not one (text that no header holds,
  longer than MAX_HEADER, or ended before `<|message|>`): its text, its markers dropped.

The style reads the whole answer, tools offered or not (WHOLE_ANSWER), from text that keeps
the special tokens. Messages of one kind follow each other with a newline between them."""

from __future__ import annotations

import json
import re
from typing import Any

from wsllm.server.chat.calls import ToolStream, loads, partial_suffix
from wsllm.server.chat.style import ToolStyle, compact, functions, lark_literal, parameters

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
MAX_HEADER = 256  # characters of a header before it is taken for text
_ENDS = re.compile(r"<\|(?:end|return|call|start)\|>")  # what ends a body
_HEADER_TEXT = re.compile(r"[\w .=:/-]*")  # what a header holds between its markers
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")


def _held(buf: str) -> int:
    """How many trailing characters of `buf` may begin a marker."""
    return max(partial_suffix(buf, m) for m in MARKERS)


def _unmark(text: str) -> str:
    """`text` without harmony's markers."""
    for m in MARKERS:
        text = text.replace(m, "")
    return text


def _header_so_far(text: str) -> bool:
    """`text` (markers and all) may begin a header: it opens with a channel, a role or a
    recipient, and holds only what headers hold between their markers."""
    s = text.lstrip()
    opens = any(s.startswith(p) or p.startswith(s) for p in (CHANNEL, "assistant", "to="))
    return opens and _HEADER_TEXT.fullmatch(" ".join(_unmark(s.replace(CHANNEL, " ")).split())) is not None


class HarmonyStream(ToolStream):
    """One answer's messages. States: `header` (reading a header), `body` (a message's body
    of kind `self._kind`: reasoning, content or call), `between` (after a message, before
    the next `<|start|>`), `text` (after a broken header: content up to the next start)."""

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        super().__init__(id_seed, arg_types)
        self._state = "header"
        self._kind = ""  # the body's: "reasoning", "content" or "call"
        self._fn = ""  # a call's function
        self._last = ""  # the kind of text said last ("call" after a call)
        self._fresh = True  # the next text opens a message (a newline after one of its kind)
        self._from = 0  # where a call's body may end, so far (its text is read once)

    def _step(self, final: bool) -> None:
        while self._buf or (final and self._state == "body" and self._kind == "call"):
            before = (self._state, len(self._buf))
            getattr(self, "_" + self._state)(final)
            if (self._state, len(self._buf)) == before:  # waits for more text
                return

    def _to(self, state: str) -> None:
        self._state = state
        self._fresh = self._fresh or state == "header"

    def _header(self, final: bool) -> None:
        buf = self._buf
        if buf.lstrip().startswith(START):  # the prompt's header, written again: a fresh start
            self._buf = buf.lstrip()[len(START) :]
            return
        i = buf.find(MESSAGE)
        head = buf if i < 0 else buf[:i]
        end = _ENDS.search(head)
        keep = 0 if final or i >= 0 else _held(head)
        broken = end is not None or len(head) > MAX_HEADER or (final and i < 0)
        if broken or not _header_so_far(head[: len(head) - keep]):  # no header: its text is content
            cut = end.start() if end is not None else len(head) - keep
            self._say("content", _unmark(head[:cut]))
            self._buf, self._state = buf[cut:], "text"
        elif i >= 0:
            self._open(head)
            self._buf = buf[i + len(MESSAGE) :]

    def _open(self, head: str) -> None:
        """A message's body begins: what it is, from its header."""
        to = _RECIPIENT.search(head)
        channel = _CHANNEL.search(head)
        name = channel.group(1) if channel else ""
        self._state, self._fn, self._from = "body", "", 0
        if to is not None and to.group(1).startswith("functions.") and len(to.group(1)) > len("functions."):
            self._kind, self._fn = "call", to.group(1)[len("functions.") :]
        elif name == "analysis":
            self._kind = "reasoning"
        else:  # final, a preamble in commentary, or a channel this style does not know
            self._kind = "content"

    def _body(self, final: bool) -> None:
        buf = self._buf
        m = _ENDS.search(buf, self._from)
        if m is None and not final:  # a call whole only; text up to a marker that may begin
            if self._kind == "call":
                self._from = max(0, len(buf) - len(RETURN) + 1)
            else:
                keep = _held(buf)
                self._say(self._kind, _unmark(buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
            return
        body = buf if m is None else buf[: m.start()]
        if self._kind == "call":
            call = self._make(self._fn, loads(body.strip()))
            if call is None:  # no arguments object: the body is text
                self._say("content", _unmark(body))
            else:
                self._emit([call])
                self._last = "call"
        else:
            self._say(self._kind, _unmark(body))
        self._buf = "" if m is None else buf[m.start() :] if m.group() == START else buf[m.end() :]
        self._to("between")

    def _between(self, final: bool) -> None:
        """After a message: whitespace up to the next `<|start|>`; other text is content."""
        buf = self._buf
        i = buf.find(START)
        keep = 0 if final or i >= 0 else _held(buf)  # a marker that may begin is no text yet
        head = buf[: len(buf) - keep] if i < 0 else buf[:i]
        if _unmark(head).strip():  # text between messages
            self._fresh = True
            self._state = "text"
        elif i >= 0:
            self._buf = buf[i + len(START) :]
            self._to("header")
        else:
            self._buf = buf[len(buf) - keep :] if keep else ""

    def _text(self, final: bool) -> None:
        """Content (its markers dropped) up to the next `<|start|>`."""
        buf = self._buf
        i = buf.find(START)
        if i < 0:
            keep = 0 if final else _held(buf)
            self._say("content", _unmark(buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep :]
        else:
            self._say("content", _unmark(buf[:i]))
            self._buf = buf[i + len(START) :]
            self._to("header")

    def _say(self, kind: str, text: str) -> None:
        """Text of a message of `kind` (reasoning or content)."""
        if not text:
            return
        if self._fresh and self._last == kind:
            text = "\n" + text
        self._fresh, self._last = False, kind
        if kind == "reasoning":
            self._out.reasoning += text
        else:
            self._content(text)


class HarmonyStyle(ToolStyle):
    name = "harmony"
    TEMPLATE_MARKS = (CHANNEL,)
    NAME_MARKS = ("gpt-oss",)
    STREAM = HarmonyStream
    WHOLE_ANSWER = True

    def instructions(self) -> str:
        return (
            "To call a function, write a message to it on the commentary channel, its arguments a JSON "
            f"object: {CHANNEL}commentary to=functions.<name> {CONSTRAIN}json{MESSAGE}<arguments object>{CALL}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "".join(
            f"{START}assistant{CHANNEL}commentary to=functions.{c['function']['name']} {CONSTRAIN}json{MESSAGE}"
            f"{json.dumps(c['function']['arguments'], ensure_ascii=False)}{CALL}"
            for c in calls
        )

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        """Lark over harmony's special tokens (`<|channel|>` unquoted: the token itself): an
        optional analysis message, then the call (one per turn unless `parallel`: gpt-oss's
        `<|call|>` ends its turn, so further calls come only where it is no stop token)."""
        fns = functions(tools, forced)
        rules = [
            f"call_{i}: <|channel|> {lark_literal('commentary to=functions.' + fn['name'] + ' ')} <|constrain|> "
            f'"json" <|message|> %json {json.dumps(compact(parameters(fn)))}'
            for i, fn in enumerate(fns)
        ]
        calls = "call" + (' (<|call|> <|start|> "assistant" call)*' if parallel and not forced else "")
        lines = [
            f"start: thought? {calls}",
            'thought: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
            r"THOUGHT: /(.|\n)*/",
            "call: " + " | ".join(f"call_{i}" for i in range(len(fns))),
            *rules,
        ]
        return {"grammar": "\n".join(lines) + "\n"}
