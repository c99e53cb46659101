"""Tool calling, request side: which output style a model uses (`choose_parser`, with
GatewayConfig.tool_parser to override), tools written into the prompt of a model whose
chat template knows none (`ToolFormat`), and the constraint that makes
`tool_choice: "required"` or a named function hold (`tool_structured`).

`plan_chat` gathers it for one request: what the chat template is given, how the
output is read, and the `structured` value for the sampler."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from wsllm.server.chat_output import OutputOptions
from wsllm.server.errors import APIError
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.text import TextCodec
from wsllm.structured import check_spec


def choose_parser(override: str, chat_template: str, model_name: str) -> str:
    """The tool-call style of a model: `override` unless it is "auto", else what its
    chat template writes, else its name; Hermes (`<tool_call>`) when nothing tells."""
    if override != "auto":
        return override
    if "<tool_call>" in chat_template:
        return "hermes"  # Hermes 2 Pro, Qwen2.5, Qwen3
    if "[TOOL_CALLS]" in chat_template or "[AVAILABLE_TOOLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"  # Llama 3.1 and later
    name = model_name.lower().replace("_", "-")
    if any(k in name for k in ("mistral", "mixtral", "ministral", "codestral")):
        return "mistral"
    if "llama-3" in name or "llama3" in name:
        return "llama3_json"
    return "hermes"


def _signature(tool: dict[str, Any]) -> str:
    return json.dumps(tool, ensure_ascii=False)


@dataclass(slots=True, frozen=True)
class ToolFormat:
    """A style's own way to write tools into a prompt and calls into a message, for
    chat templates that know nothing of tools (text.ToolPrompt)."""

    parser: str

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(_signature(t) for t in tools)
        if self.parser == "hermes":
            how = (
                "To call a function, answer with one line per call, each a JSON object with the "
                'function\'s name and arguments between tags: <tool_call>{"name": <name>, '
                '"arguments": <arguments object>}</tool_call>'
            )
        elif self.parser == "mistral":
            how = (
                "To call functions, answer with a JSON list of calls, each with the function's name "
                'and arguments: [{"name": <name>, "arguments": <arguments object>}]'
            )
        else:
            how = (
                "To call a function, answer with only a JSON object of its name and arguments: "
                '{"name": <name>, "parameters": <arguments object>}; separate several calls with ";"'
            )
        return f"You can call these functions, given as JSON schemas:\n<tools>\n{listing}\n</tools>\n{how}"

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An earlier turn's calls, written as the model would have written them."""
        key = "parameters" if self.parser == "llama3_json" else "arguments"
        objs = [{"name": c["function"]["name"], key: c["function"]["arguments"]} for c in calls]
        if self.parser == "hermes":
            return "\n".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objs)
        if self.parser == "mistral":
            return "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)

    def inline(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with the tools in the system message and earlier calls in
        their assistant messages' text; tool results are user turns, tagged."""
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


def call_schema(tools: list[dict[str, Any]], parser: str, only: str = "") -> dict[str, Any]:
    """JSON schema of one call object in `parser`'s style, to any of `tools` (or the
    one named `only`)."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    options = []
    for t in tools:
        fn = t["function"]
        if only and fn["name"] != only:
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    key: fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_structured(tools: list[dict[str, Any]], parser: str, forced: str, parallel: bool) -> dict[str, Any]:
    """The `structured` constraint (SamplingParams.structured: {"json"} or {"grammar"}
    in llguidance's Lark) under which the output is calls and nothing else: one call to
    the function named `forced`, or, when `forced` is "" (tool_choice "required"), one
    or more calls (one unless `parallel`) to any of `tools`."""
    one = call_schema(tools, parser, forced)
    # compact JSON inside Lark too (as JSON_DEFAULTS does for {"json"}): a model must
    # not be able to pad a call with whitespace until max_tokens
    compact = one | {"x-guidance": {"whitespace_flexible": False}}
    many = parallel and not forced
    if parser == "llama3_json":
        if not many:
            return {"json": one}
        body = f"call: %json {json.dumps(compact)}"
        return {"grammar": f'start: call ("; " call)*\n{body}\n'}
    if parser == "mistral":  # [TOOL_CALLS] is a special token the gateway never sees: the list is the call
        return {"json": {"type": "array", "items": one, "minItems": 1} | ({} if many else {"maxItems": 1})}
    rep = ' ("\\n" tool_call)*' if many else ""
    return {
        "grammar": f'start: tool_call{rep}\ntool_call: "<tool_call>\\n" call "\\n</tool_call>"\n'
        f"call: %json {json.dumps(compact)}\n"
    }


@dataclass(slots=True)
class ChatPlan:
    """One chat request's tool and reasoning set-up."""

    #: keyword arguments of TextCodec.encode_chat beside the messages
    template: dict[str, Any] = field(default_factory=dict)
    #: how the Generation reads the output
    output: OutputOptions = field(default_factory=OutputOptions)
    #: fields for SamplingParams: {"structured": ...} when tool_choice forces a call
    sampling: dict[str, Any] = field(default_factory=dict)


def plan_chat(req: ChatRequest, codec: TextCodec, model_name: str, tool_parser: str = "auto") -> ChatPlan:
    """The plan of a checked chat request to `model_name` (whose tokenizer is `codec`);
    `tool_parser` is GatewayConfig.tool_parser."""
    tools = req.offered_tools
    plan = ChatPlan()
    if req.chat_template_kwargs:
        plan.template["template_kwargs"] = dict(req.chat_template_kwargs)
    if not tools:
        return plan
    parser = choose_parser(tool_parser, codec.chat_template, model_name)
    plan.template |= {"tools": tools, "tool_prompt": ToolFormat(parser)}
    plan.output = OutputOptions(tool_parser=parser)
    forced = req.forced_tool
    if forced is not None:
        parallel = req.parallel_tool_calls is not False
        plan.sampling["structured"] = tool_structured(tools, parser, forced, parallel)
    return plan


def wanted_constraint(
    req: ChatRequest | CompletionRequest, plan: ChatPlan | None
) -> tuple[dict[str, Any], str] | None:
    """The one structured-output constraint a checked request asks for, with the field
    that asked: its `response_format` / `structured_outputs`, or the call a forcing
    `tool_choice` needs (not both); None for free text. Cheap."""
    asked = req.structured
    forced = plan.sampling.get("structured") if plan is not None else None
    if asked is not None and forced is not None:
        raise APIError(
            400,
            "invalid_request",
            "tool_choice: a forced call cannot be combined with response_format",
            "tool_choice",
        )
    if asked is not None:
        return asked
    return None if forced is None else (forced, "tool_choice")


def checked(spec: dict[str, Any], param: str) -> dict[str, Any]:
    """`spec`, compiled once with llguidance: one that does not compile is a 400 naming
    `param`. Milliseconds for ordinary schemas; run it off the event loop."""
    try:
        check_spec(spec)
    except ValueError as e:
        raise APIError(400, "invalid_request", f"{param}: {e}", param=param) from None
    return spec
