"""What one forward pass hands back (`ModelRunner.run`), on the host: the tokens its token stage
sampled per sequence, their logprobs, the prompt logprobs it computed and the pooled vectors of
embedding requests. `Scheduler.update_from_output` reads it; nothing here holds a device tensor.
Torch-free at run time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wsllm.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Sampled:
    """One sequence's samples in this step."""

    seq: Sequence
    # One token per row the sequence sampled at: after its last token, then after each of its
    # drafts (1 + len(seq.draft_token_ids)); -1 where that row's sampling failed (`error`).
    token_ids: list[int]
    # Per row: [chosen logprob, [[token, logprob], ... top N]] where its params ask for them.
    logprobs: list[Any]
    # n > 1: a choice that forks from `parent` in this step (sampled from the parent's row).
    parent: Sequence | None = None
    # Beam search: the best next tokens of the beam and their logprobs (it appends none itself).
    candidates: list[tuple[int, float]] | None = None
    error: str | None = None  # why sampling failed (its request fails)


@dataclass(slots=True)
class PromptLogprobs:
    seq: Sequence
    first: int  # the prompt position of entries[0] (>= 1: the first prompt token has none)
    entries: list[Any]  # per prompt token: (logprob, ((tok, lp), ...top N)): tuples, see ModelRunner


@dataclass(slots=True)
class Pooled:
    seq: Sequence
    start: int  # the first position of this step's chunk
    num_tokens: int  # positions in the chunk
    caught_up: bool  # the chunk ends at the sequence's last token
    vector: torch.Tensor  # [hidden] fp32, host: the chunk's sum (mean) or its last row (last)


@dataclass(slots=True)
class ModelOutput:
    # The sequences that sampled, in batch order, then the choices forking from them.
    sampled: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    pooled: list[Pooled] = field(default_factory=list)
