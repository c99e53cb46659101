"""wsllm: LLM serving over WebSockets and SSE."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wsllm.types import SamplingParams

if TYPE_CHECKING:
    from wsllm.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it only when asked so `wsllm.types` stays light.
    if name == "LLM":
        from wsllm.llm import LLM

        return LLM
    raise AttributeError(name)
