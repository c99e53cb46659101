"""A chat request's plan, from its tool fields and the model's tool-call style
(registry.choose_style, GatewayConfig.tool_parser to override): what the chat template is
given (the tools, or the style that writes them into a template that knows none), how the
output is read, and the `structured` value that makes `tool_choice: "required"` or a
named function hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wsllm.server.chat.output import OutputOptions
from wsllm.server.chat.registry import choose_style
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.text import TextCodec


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
    if not req.add_generation_prompt or req.continue_final_message:  # vLLM's switches of the template
        plan.template |= {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }
    style = choose_style(tool_parser, codec.chat_template, model_name)
    if style.WHOLE_ANSWER:  # its answers are read by the style, tools or not (harmony)
        plan.output = OutputOptions(tool_parser=style.name, arg_types=style.arg_types(tools or []))
    if not tools:
        return plan
    plan.template |= {"tools": tools, "tool_prompt": style}
    plan.output = OutputOptions(tool_parser=style.name, arg_types=style.arg_types(tools))
    forced = req.forced_tool
    if forced is not None:
        parallel = req.parallel_tool_calls is not False
        plan.sampling["structured"] = style.constraint(tools, forced, parallel)
    return plan


def wanted_constraint(
    req: ChatRequest | CompletionRequest, plan: ChatPlan | None
) -> tuple[dict[str, Any], str] | None:
    """The one structured-output constraint a checked request asks for, with the field
    that asked: its `response_format` / `structured_outputs`, or the call a forcing
    `tool_choice` needs (validation refused both at once); None for free text. Cheap."""
    asked = req.structured
    forced = plan.sampling.get("structured") if plan is not None else None
    if asked is not None:
        return asked
    return None if forced is None else (forced, "tool_choice")
