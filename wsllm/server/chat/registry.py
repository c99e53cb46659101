"""The tool-call styles by name: the one list of them (GatewayConfig.tool_parser's
choices come from here). Adding a style is one module in styles/ and one line below.

The order is the order of detection: a model's style is the first whose marks its chat
template contains, else the first whose marks its name contains, else `DEFAULT`. A style
whose template marks another's contains comes first (Qwen3-Coder's templates also write
`<tool_call>`; Llama 4's also know `ipython`)."""

from __future__ import annotations

from wsllm.server.chat.style import ToolStyle
from wsllm.server.chat.styles.harmony import HarmonyStyle
from wsllm.server.chat.styles.hermes import HermesStyle
from wsllm.server.chat.styles.llama3_json import Llama3JsonStyle
from wsllm.server.chat.styles.mistral import MistralStyle
from wsllm.server.chat.styles.pythonic import PythonicStyle
from wsllm.server.chat.styles.qwen3_coder import Qwen3CoderStyle

STYLES: dict[str, type[ToolStyle]] = {
    HarmonyStyle.name: HarmonyStyle,
    Qwen3CoderStyle.name: Qwen3CoderStyle,
    HermesStyle.name: HermesStyle,
    MistralStyle.name: MistralStyle,
    PythonicStyle.name: PythonicStyle,
    Llama3JsonStyle.name: Llama3JsonStyle,
}
#: the style of a model nothing tells about (Hermes is the most widely trained)
DEFAULT = HermesStyle.name


def style_names() -> tuple[str, ...]:
    return tuple(STYLES)


def get_style(name: str) -> ToolStyle:
    """The style named `name`; ValueError naming the known ones otherwise."""
    try:
        return STYLES[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; one of {', '.join(STYLES)}") from None


def choose_style(override: str, chat_template: str, model_name: str) -> ToolStyle:
    """The tool-call style of a model: `override` (GatewayConfig.tool_parser) unless it
    is "auto", else what its chat template writes, else what its name says."""
    if override != "auto":
        return get_style(override)
    found = next((s for s in STYLES.values() if s.speaks(chat_template)), None)
    found = found or next((s for s in STYLES.values() if s.named(model_name)), None)
    return (found or STYLES[DEFAULT])()
