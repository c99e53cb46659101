"""Llama 3.2 and Llama 4, pythonic: the output opens with a Python list of calls with
keyword arguments, `[get_weather(city="Paris"), other(x=1)]`, optionally between
`<|python_start|>` and `<|python_end|>`; text after the list is content.

The list is read with `ast.parse` and each value with `ast.literal_eval` (literals only:
no name is looked up, nothing runs). JSON's `true`, `false` and `null` count as Python's
`True`, `False` and `None`, as models write both. A function whose name is no Python
dotted identifier (one with `-`) cannot be called in this style."""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from wsllm.server.chat.calls import BracketScan, ToolStream
from wsllm.server.chat.style import ToolStyle, compact, fields, functions, lark_literal, one_or_many

_IDENT = re.compile(r"[A-Za-z_][\w.]*")  # a function name, dotted or not
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _plain(value: Any) -> Any:
    """`value` as JSON has it (tuples as lists); ValueError for what JSON has not."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"not a JSON value: {type(value).__name__}")


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a name or an attribute chain; None for any other expression."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def read_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The (name, arguments) of a Python list of calls; None when `text` is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            name = _dotted(node.func)
            args: dict[str, Any] = {}
            for kw in node.keywords:
                if name is None or kw.arg is None:  # **kwargs
                    return None
                args[kw.arg] = _plain(ast.literal_eval(_JsonNames().visit(kw.value)))
            if name is None:
                return None
            calls.append((name, args))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class PythonicStream(ToolStream):
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> None:
        super().__init__(id_seed, arg_types)
        self._mode = "start"  # start -> calls -> after (the list) -> content (for good)
        self._ended = False  # the END tag after the list was dropped
        self._scan = BracketScan("\"'")

    def _step(self, final: bool) -> None:
        if self._mode == "start":
            self._start(final)
        if self._mode == "calls":
            self._list(final)
        if self._mode == "after":
            self._after(final)
        if self._mode == "content":
            self._content(self._buf)
            self._buf = ""

    def _start(self, final: bool) -> None:
        """Decide whether the output opens with a call list; stays "start" while it
        cannot tell."""
        head = self._buf.lstrip()
        if head.startswith(self.START):
            head = head[len(self.START) :].lstrip()
        elif self.START.startswith(head) and not final:  # nothing yet, or part of the tag
            return
        if not head and not final:
            return
        after = head[1:].lstrip()
        name = _IDENT.match(after)
        if not head.startswith("[") or (after and name is None):
            self._mode = "content"
            return
        rest = after[name.end() :].lstrip() if name else ""
        if rest.startswith("("):
            self._mode, self._buf = "calls", head
        elif rest or final:
            self._mode = "content"

    def _list(self, final: bool) -> None:
        buf = self._buf
        end = self._scan.end(buf)
        if end is None and not final:
            return
        calls = read_calls(buf[:end]) if end is not None else None
        if calls is not None:
            made = [self._make(name, args, k) for k, (name, args) in enumerate(calls)]
            if all(c is not None for c in made):
                self._emit([c for c in made if c is not None])
                self._buf, self._mode = buf[end:], "after"
                return
        self._mode = "content"  # a broken list: all of it is content

    def _after(self, final: bool) -> None:
        """Drop the whitespace and the END tag that follow the list."""
        head = self._buf.lstrip()
        if not self._ended and head.startswith(self.END):
            self._ended, head = True, head[len(self.END) :].lstrip()
        self._buf = head
        if final or (head and (self._ended or not self.END.startswith(head))):
            self._mode = "content"


def _args_lark(items: list[tuple[str, bool]]) -> str:
    """Lark for keyword arguments `items` (rule name, required), in their order: the
    required ones, then any of the optional ones, ", " between them."""
    req = [r for r, need in items if need]
    opt = [r for r, need in items if not need]
    if req:
        return " ".join([req[0], *(f'", " {r}' for r in req[1:]), *(f'(", " {o})?' for o in opt)])
    alts = [" ".join([o, *(f'(", " {p})?' for p in opt[k + 1 :])]) for k, o in enumerate(opt)]
    return f"({' | '.join(alts)})?" if alts else ""


class PythonicStyle(ToolStyle):
    name = "pythonic"
    TEMPLATE_MARKS = ("<|python_start|>", "[func_name1(")
    NAME_MARKS = ("llama-4", "llama4")
    STREAM = PythonicStream

    def instructions(self) -> str:
        return (
            "To call functions, answer with only a Python list of calls with keyword arguments: "
            "[func_name1(arg1=value1, arg2=value2), func_name2(arg=value)]"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        made = []
        for c in calls:
            args = ", ".join(f"{k}={v!r}" for k, v in c["function"]["arguments"].items())
            made.append(f"{c['function']['name']}({args})")
        return f"[{', '.join(made)}]"

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        # values are written as compact JSON, which the reader takes (true/false/null)
        rules, alts = [], []
        for i, fn in enumerate(functions(tools, forced)):
            items = []
            for j, (key, schema, required) in enumerate(fields(fn)):
                rules.append(f"f{i}_a{j}: {lark_literal(key + '=')} f{i}_v{j}")
                rules.append(f"f{i}_v{j}: %json {json.dumps(compact(schema))}")
                items.append((f"f{i}_a{j}", required))
            rules.append(f'f{i}: {lark_literal(fn["name"] + "(")} {_args_lark(items)} ")"')
            alts.append(f"f{i}")
        rules.append(f"call: {' | '.join(alts)}")
        return {
            "grammar": f'start: "[" {one_or_many("call", ", ", parallel and not forced)} "]"\n'
            + "\n".join(rules)
            + "\n"
        }
