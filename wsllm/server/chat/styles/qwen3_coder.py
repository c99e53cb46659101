"""Qwen3-Coder: XML-like calls, one argument per block, any number of calls, text before
them being the answer's content:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is written bare: the text of a string, JSON for anything else. So the reader
needs each parameter's type from the offered tools' schemas (`arg_types`, kept in the
resume context): a string parameter's value is its text (one newline each side is the
format's, dropped), any other is read as JSON, then as a Python literal, else kept as
text. A parameter the schemas do not name is text."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from wsllm.server.chat.calls import ToolCall, loads
from wsllm.server.chat.style import ToolStyle, compact, fields, functions, lark_literal, one_or_many
from wsllm.server.chat.styles.hermes import HermesStream

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_JSON_TYPES: list[tuple[type | tuple[type, ...], str]] = [
    (bool, "boolean"),  # before int: a bool is an int in Python
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (type(None), "null"),
    (list, "array"),
    (dict, "object"),
]


def json_type(value: Any) -> str | None:
    """The JSON type of a Python value; None for one JSON has not (a tuple, bytes)."""
    return next((name for cls, name in _JSON_TYPES if isinstance(value, cls)), None)


def json_types(schema: dict[str, Any]) -> list[str]:
    """The JSON types a parameter's schema allows ([]: it does not say)."""
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "enum" in schema or "const" in schema:
        enum = schema.get("enum")
        values = enum if isinstance(enum, list) else [schema.get("const")]
        return sorted({t for v in values if (t := json_type(v)) is not None})
    alts = schema.get("anyOf") or schema.get("oneOf") or []
    return sorted({x for a in alts if isinstance(a, dict) for x in json_types(a)})


def _fits(value: Any, types: list[str]) -> bool:
    t = json_type(value)
    if t is None:
        return False
    whole = t == "number" and float(value).is_integer()
    return not types or t in types or (t == "integer" and "number" in types) or (whole and "integer" in types)


def typed(raw: str, types: list[str] | None) -> Any:
    """A bare value read by its parameter's JSON types (None: an unknown parameter)."""
    if types is None or types == ["string"]:
        return raw
    value = loads(raw)
    if (value is not None or raw.strip() == "null") and _fits(value, types):
        return value
    if "string" in types:
        return raw
    try:  # a Python literal: True, 'single quotes'
        value = ast.literal_eval(raw.strip())
        same = loads(json.dumps(value)) == value  # JSON's own (no tuples, sets, infinities)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw
    return value if same and _fits(value, types) else raw


class Qwen3CoderStream(HermesStream):
    """Hermes's `<tool_call>` blocks, with XML inside."""

    def _read(self, body: str) -> ToolCall | None:
        """The call in one block's body; None when it is not one."""
        m = _FUNCTION.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        types = self.arg_types.get(name) or {}
        args: dict[str, Any] = {}
        pos = 0
        for p in _PARAMETER.finditer(inner):
            if inner[pos : p.start()].strip():  # text between the blocks: not this format
                return None
            key, raw = p.group(1).strip(), p.group(2)
            raw = raw.removeprefix("\n").removesuffix("\n")
            args[key] = typed(raw, types.get(key))
            pos = p.end()
        if inner[pos:].strip():
            return None
        return self._make(name, args)


_CLOSE = "\n</parameter>\n"


def _value_lark(schema: dict[str, Any]) -> str:
    """Lark for a bare value and the tag that closes it: a string's text (without '<',
    which could start the tag; within its length bounds, or one of its enum), else JSON.
    A free string and its tag are one regex: as a terminal of its own, the text would
    take the newline that starts the tag."""
    if json_types(schema) != ["string"]:
        return f"%json {json.dumps(compact(schema))} {lark_literal(_CLOSE)}"
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return f"({' | '.join(lark_literal(v) for v in schema['enum'])}) {lark_literal(_CLOSE)}"
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    count = "*" if not low and high is None else f"{{{low},{'' if high is None else int(high)}}}"
    return f"/[^<]{count}\\n<\\/parameter>\\n/"


class Qwen3CoderStyle(ToolStyle):
    name = "qwen3_coder"
    TEMPLATE_MARKS = ("<function=",)
    NAME_MARKS = ("qwen3-coder",)
    STREAM = Qwen3CoderStream

    def instructions(self) -> str:
        return (
            "To call a function, answer with one block per call, one parameter block per argument:\n"
            "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n"
            "</tool_call>\nA string value is written as it is, any other value as JSON."
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = []
        for c in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                for k, v in c["function"]["arguments"].items()
            )
            blocks.append(
                f"<tool_call>\n<function={c['function']['name']}>\n{params}</function>\n</tool_call>"
            )
        return "\n".join(blocks)

    def arg_types(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {fn["name"]: {k: json_types(s) for k, s, _ in fields(fn)} for fn in functions(tools)}

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        rules, alts = [], []
        for i, fn in enumerate(functions(tools, forced)):
            parts = []
            for j, (key, schema, required) in enumerate(fields(fn)):
                rules.append(f"f{i}_v{j}: {_value_lark(schema)}")
                block = f"{lark_literal(f'<parameter={key}>' + chr(10))} f{i}_v{j}"
                parts.append(f"({block})" + ("" if required else "?"))
            head = lark_literal(f"<function={fn['name']}>\n")
            rules.append(f'f{i}: {" ".join([head, *parts])} "</function>\\n"')
            alts.append(f"f{i}")
        return {
            "grammar": f"start: {one_or_many('call', chr(10), parallel and not forced)}\n"
            f'call: "<tool_call>\\n" ({" | ".join(alts)}) "</tool_call>"\n' + "\n".join(rules) + "\n"
        }
