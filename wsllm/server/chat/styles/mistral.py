"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. The marker is a special
token, which the detokenizer drops, so an output that *starts* with a JSON array of calls
counts too."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from wsllm.server.chat.calls import BracketScan, ToolStream, loads, partial_suffix
from wsllm.server.chat.style import ToolStyle, call_schema


class MistralStream(ToolStream):
    MARK = "[TOOL_CALLS]"

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        super().__init__(id_seed, arg_types)
        self._mode = "start"  # start | content | calls
        self._marked = False  # the calls came after the marker (else: a bare array at the start)
        self._scan = BracketScan()

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
        value = loads(buf[:end]) if end is not None else None
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


class MistralStyle(ToolStyle):
    name = "mistral"
    TEMPLATE_MARKS = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")
    NAME_MARKS = ("mistral", "mixtral", "ministral", "codestral")
    STREAM = MistralStream

    def instructions(self) -> str:
        return (
            "To call functions, answer with a JSON list of calls, each with the function's name "
            'and arguments: [{"name": <name>, "arguments": <arguments object>}]'
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objs = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        # [TOOL_CALLS] is a special token the gateway never sees: the list is the call
        many = parallel and not forced
        one = call_schema(tools, "arguments", forced)
        return {"json": {"type": "array", "items": one, "minItems": 1} | ({} if many else {"maxItems": 1})}
