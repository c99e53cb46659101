"""Hermes 2 Pro, Qwen2.5, Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them, text before them being the answer's content. The style of a model
nothing else claims."""

from __future__ import annotations

import json
from typing import Any

from wsllm.server.chat.calls import ToolCall, ToolStream, loads, partial_suffix
from wsllm.server.chat.style import ToolStyle, call_schema, compact, one_or_many


class HermesStream(ToolStream):
    """Calls in `<tool_call>` blocks, anywhere after the content; `_read` reads a block."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        super().__init__(id_seed, arg_types)
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
        call = self._read(body.strip())
        if call is None:
            self._content(self.OPEN + body + close)
        else:
            self._emit([call])

    def _read(self, body: str) -> ToolCall | None:
        """The call in one block's body; None when it is not one."""
        return self._call(loads(body))


class HermesStyle(ToolStyle):
    name = "hermes"
    TEMPLATE_MARKS = ("<tool_call>",)
    STREAM = HermesStream

    def instructions(self) -> str:
        return (
            "To call a function, answer with one line per call, each a JSON object with the "
            'function\'s name and arguments between tags: <tool_call>{"name": <name>, '
            '"arguments": <arguments object>}</tool_call>'
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objs = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return "\n".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objs)

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        one = compact(call_schema(tools, "arguments", forced))
        return {
            "grammar": f"start: {one_or_many('tool_call', chr(10), parallel and not forced)}\n"
            'tool_call: "<tool_call>\\n" call "\\n</tool_call>"\n'
            f"call: %json {json.dumps(one)}\n"
        }
