"""A tool-call style: how one family of models writes calls. One `ToolStyle` subclass
per style (chat/styles/, listed in chat/registry.py) owns all of it:

- detection: `TEMPLATE_MARKS`, text its chat templates contain, and `NAME_MARKS`, pieces
  of its models' names (the registry asks every style's template first, then names);
- prompt: `instructions()` and `render_calls()`, for chat templates that know nothing of
  tools: `inline()` writes the tools into the system message and earlier calls into
  their assistant turns, in the style the model is then read in;
- constraint: `constraint()`, the `structured` value (SamplingParams.structured) under
  which the output is calls in the style and nothing else (tool_choice "required" or a
  named function);
- reading: `STREAM`, its incremental parser (chat/calls.py), with `arg_types()` for a
  style that writes arguments untyped and needs the tools' schemas to read them; a style
  whose answers are all structure (harmony's channels) reads the whole answer
  (`WHOLE_ANSWER`).

A style holds no state: an instance is a handle on its class."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from wsllm.server.chat.calls import Parsed, ToolStream


def functions(tools: list[dict[str, Any]], only: str = "") -> list[dict[str, Any]]:
    """The `function` objects of `tools` (of the one named `only`, when given)."""
    return [t["function"] for t in tools if not only or t["function"]["name"] == only]


def parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (an object of any properties when it has none)."""
    return fn.get("parameters") or {"type": "object"}


def fields(fn: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """A function's named arguments as (name, schema, required): the required ones
    first, each group in the order of `properties`. For the styles that write one
    argument at a time (a schema that is not an object of properties has none)."""
    schema = parameters(fn)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    named = [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]
    return [f for f in named if f[2]] + [f for f in named if not f[2]]


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` for a `%json` inside Lark: compact JSON (as JSON_DEFAULTS does for
    {"json"}), so that a model cannot pad a call with whitespace until max_tokens."""
    return schema | {"x-guidance": {"whitespace_flexible": False}}


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def one_or_many(item: str, sep: str, many: bool) -> str:
    """Lark for one `item`, or one or more separated by the literal `sep`."""
    return f"{item} ({lark_literal(sep)} {item})*" if many else item


def call_schema(tools: list[dict[str, Any]], args_key: str, only: str = "") -> dict[str, Any]:
    """JSON schema of one call object `{"name": ..., args_key: {...}}` to any of
    `tools` (or the one named `only`), for the styles that write calls as JSON."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: parameters(fn)},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for fn in functions(tools, only)
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolStyle:
    #: the style's name: --tool-parser's value, kept in a request's resume context
    name: ClassVar[str]
    #: text that only chat templates of this style contain
    TEMPLATE_MARKS: ClassVar[tuple[str, ...]] = ()
    #: pieces of the (lower-case, "-" for "_") names of this style's models
    NAME_MARKS: ClassVar[tuple[str, ...]] = ()
    #: the style's incremental parser
    STREAM: ClassVar[type[ToolStream]]
    #: its stream reads the whole answer: reasoning, content and calls, tools offered or not,
    #: from text that keeps the special tokens (the `<think>` splitter then stays out)
    WHOLE_ANSWER: ClassVar[bool] = False

    @classmethod
    def speaks(cls, chat_template: str) -> bool:
        """This chat template writes calls in this style."""
        return any(m in chat_template for m in cls.TEMPLATE_MARKS)

    @classmethod
    def named(cls, model_name: str) -> bool:
        """`model_name` is one of this style's models."""
        name = model_name.lower().replace("_", "-")
        return any(m in name for m in cls.NAME_MARKS)

    def instructions(self) -> str:
        """How to call a function, told to a model whose template knows no tools."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An earlier turn's calls (OpenAI's shape, arguments as objects), written as
        the model would have written them."""
        raise NotImplementedError

    def constraint(self, tools: list[dict[str, Any]], forced: str, parallel: bool) -> dict[str, Any]:
        """The `structured` constraint (llguidance: {"json": schema} or {"grammar":
        lark}) under which the output is one call to the function named `forced`, or,
        when `forced` is "" (tool_choice "required"), one or more calls (one unless
        `parallel`) to any of `tools`."""
        raise NotImplementedError

    def arg_types(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """What the stream needs to know of the offered tools to read calls (JSON, kept
        in the resume context); nothing for a style whose calls carry typed values."""
        return {}

    def stream(self, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> ToolStream:
        """A fresh incremental parser; `id_seed` makes the call ids (the same on a replay)."""
        return self.STREAM(id_seed, arg_types)

    def parse(self, text: str, id_seed: str = "", arg_types: dict[str, Any] | None = None) -> Parsed:
        """The whole output at once: its content and its calls."""
        return self.stream(id_seed, arg_types).parse(text)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            f"You can call these functions, given as JSON schemas:\n<tools>\n{listing}\n</tools>\n"
            + self.instructions()
        )

    def inline(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with the tools in the system message and earlier calls in
        their assistant messages' text; tool results are user turns, tagged
        (text.ToolPrompt)."""
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.get("tool_calls"):
                text = "\n".join(p for p in (m["content"], self.render_calls(m["tool_calls"])) if p)
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            else:
                out.append(m)
        prompt = self.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out
