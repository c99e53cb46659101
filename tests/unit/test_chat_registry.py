"""The tool-call style registry (wsllm/server/chat/registry.py): the style chosen per
model from its chat template, then its name, the flag that overrides it, and the
--tool-parser choices, which are the registry's."""

from __future__ import annotations

import argparse

import pytest

from wsllm.config import add_arguments, from_args
from wsllm.config_gateway import GatewayConfig
from wsllm.server.chat.registry import STYLES, choose_style, get_style

QWEN3_CODER_TEMPLATE = (
    "{%- for tool in tools %}<function>\n<name>{{ tool.name }}</name>{% endfor %}"
    "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ args_name }}>\n"
)


@pytest.mark.parametrize(
    ("template", "name", "parser"),
    [
        ("{%- if tools %}<tools>{% endif %}<tool_call>", "Qwen2.5-7B-Instruct", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}...[TOOL_CALLS]", "whatever", "mistral"),
        ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "meta", "llama3_json"),
        ("", "mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
        ("", "meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
        ("", "meta-llama/Llama-3.2-3B-Instruct", "llama3_json"),  # JSON unless its template says
        ("<|im_start|>", "SmolLM2-135M-Instruct", "hermes"),
        (QWEN3_CODER_TEMPLATE, "some-finetune", "qwen3_coder"),  # though it writes <tool_call> too
        ("", "Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
        ("ipython ... <|python_start|>", "meta", "pythonic"),  # Llama 4's tags win over ipython
        ("[func_name1(params_name1=params_value1, ...)]", "llama-3.2-1b-pythonic", "pythonic"),
        ("", "meta-llama/Llama-4-Scout-17B-16E-Instruct", "pythonic"),
    ],
)
def test_style_per_model(template: str, name: str, parser: str) -> None:
    assert choose_style("auto", template, name).name == parser
    assert choose_style("mistral", template, name).name == "mistral"  # the flag wins


def test_every_style_is_named_once_and_found_by_its_name() -> None:
    assert all(get_style(name).name == name for name in STYLES)
    with pytest.raises(ValueError, match="unknown tool parser 'xml'; one of harmony, qwen3_coder, hermes"):
        get_style("xml")


def test_the_tool_parser_option_takes_the_registry_s_styles() -> None:
    for name in ("auto", *STYLES):
        assert GatewayConfig(tool_parser=name).tool_parser == name
    with pytest.raises(ValueError, match="tool_parser must be one of auto, harmony, qwen3_coder"):
        GatewayConfig(tool_parser="xml")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, GatewayConfig)
    assert (
        from_args(GatewayConfig, parser.parse_args(["--tool-parser", "pythonic"])).tool_parser == "pythonic"
    )
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--tool-parser", "xml"])
