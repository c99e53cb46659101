"""What `LLMEngine.step()` returns. Torch-free, so the worker and `bench/` import it
without pulling in the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class CompletionOutput:
    index: int  # the choice (n > 1) or the rank of a beam hypothesis
    new_token_ids: list[int]  # produced in this step
    num_tokens: int  # output tokens so far, this step's included
    finish_reason: str | None = None
    new_logprobs: list[Any] | None = None  # per new token: [chosen_logprob, [[tok, lp], ...]]
    # Every output token, filled once the choice has finished (never copied per step).
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    queue_time: float | None = None  # seconds from arrival to first schedule, on the first output
    # Once, on the first output after the prompt is computed (params.prompt_logprobs set):
    # per prompt token, None for the first, else [logprob, [[tok, lp], ...top N]]
    prompt_logprobs: list[Any] | None = None
    # Set when the engine could not serve this request (its other outputs are empty):
    # a machine-readable code and a message a person can read.
    error_code: str | None = None
    error: str | None = None


__all__ = ["CompletionOutput", "RequestOutput"]
