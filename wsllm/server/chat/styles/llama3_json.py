"""Llama 3.1 and later: the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

import json
from typing import Any

from wsllm.server.chat.calls import BracketScan, ToolStream, loads
from wsllm.server.chat.style import ToolStyle, call_schema, compact


class Llama3JsonStream(ToolStream):
    TAG = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        super().__init__(id_seed, arg_types)
        self._mode = "start"  # start -> json (calls) -> content (for good)
        self._sep = False  # a ';' came after the last call
        self._scan = BracketScan()

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
            call = self._call(loads(buf[:end])) if end and end > 0 else None
            if call is None:  # broken or not a call: the rest is content
                self._mode = "content"
                return
            self._emit([call])
            self._buf, self._sep = buf[end:], False


class Llama3JsonStyle(ToolStyle):
    name = "llama3_json"
    TEMPLATE_MARKS = ("<|python_tag|>", "ipython")
    NAME_MARKS = ("llama-3", "llama3")
    STREAM = Llama3JsonStream

    def instructions(self) -> str:
        return (
            "To call a function, answer with only a JSON object of its name and arguments: "
            '{"name": <name>, "parameters": <arguments object>}; separate several calls with ";"'
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objs = [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls]
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        one = call_schema(tools, "parameters", forced)
        if not parallel or forced:
            return {"json": one}
        return {"grammar": f'start: call ("; " call)*\ncall: %json {json.dumps(compact(one))}\n'}
