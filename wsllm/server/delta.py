"""What one request's text work (generation.py) hands a transport: `Delta`, the new
text of one choice (content, reasoning, tool calls, logprobs, its finish), with each
token's `TokenLogprob`; and `merge`, the deltas of events that queued up while a client
was slow, one per choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Delta:
    """New text for one choice. `finish_reason` is set on the choice's last delta."""

    index: int
    text: str  # the answer's content
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_tokens: int = 0
    reasoning: str = ""  # chat: text of the <think> block
    tool_calls: list[dict[str, Any]] | None = None  # chat: OpenAI-shaped tool_calls deltas
    token_ids: list[int] = field(default_factory=list)  # the tokens that made it (vLLM's `token_ids`)


def merge(deltas: list[Delta]) -> list[Delta]:
    """One delta per choice: events that queued up while the client was slow go out
    together (clients expect a choice at most once per chunk)."""
    by_index: dict[int, Delta] = {}
    for d in deltas:
        m = by_index.get(d.index)
        if m is None:
            by_index[d.index] = d
            continue
        m.text += d.text
        m.reasoning += d.reasoning
        m.num_tokens += d.num_tokens
        m.token_ids = [*m.token_ids, *d.token_ids]  # a new list: the event's own stays as it came
        if d.tool_calls:
            m.tool_calls = (m.tool_calls or []) + d.tool_calls
        m.finish_reason = d.finish_reason or m.finish_reason
        if d.logprobs:
            m.logprobs = (m.logprobs or []) + d.logprobs
    return list(by_index.values())
