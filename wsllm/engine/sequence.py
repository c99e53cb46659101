"""A sequence is one choice of one request: its tokens, how far the KV cache has
caught up with them, and when it stops (`append_token`)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from wsllm.prefix_hash import ImageSpan
from wsllm.prompt_image import PromptImage
from wsllm.types import ERR_INTERNAL, ERR_INVALID_REQUEST, FINISH_LENGTH, FINISH_STOP, SamplingParams

_ids = itertools.count()


class TokenView:
    """A read-only view of prompt + output tokens: slicing copies only the slice."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, key: slice) -> list[int]:
        p = len(self._prompt)
        a, b, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenView takes plain slices")
        if a >= p:
            return self._output[a - p : b - p]
        if b <= p:
            return self._prompt[a:b]
        return self._prompt[a:] + self._output[: b - p]

    def __iter__(self) -> Iterator[int]:
        yield from self._prompt
        yield from self._output


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int  # choice number within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Prefill, chunked prefill, prefix hits and
    # decode are all this counter catching up with len(token_ids).
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # produced in this step
    new_logprobs: list[Any] = field(default_factory=list)
    priority: int = 0  # higher is admitted first (and preempted last)
    tenant: str = ""  # who asked: the batch is shared fairly between tenants
    # The prefix cache's namespace: its chains start here (prefix_hash.cache_root; None: the
    # common root). Sequences of different roots never share a cached block.
    cache_root: bytes | None = None
    # Its prompt's images (a model that sees: engine/encoder_step.py reads their files) and
    # their spans as the prefix cache keys the blocks holding their placeholders
    images: tuple[PromptImage, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()
    # The LoRA adapter its rows run under (models/lora.py: LoraAdapter; None: the base)
    lora: Any = None
    # Structured output: an llguidance LLMatcher that has consumed exactly output_token_ids
    # (it survives a preemption with them, so nothing is replayed), None otherwise and
    # once the sequence has finished.
    matcher: Any = None
    # Speculative decoding (engine/speculative/): the tokens proposed to verify in this step
    # beside the last one (the scheduler trims them to what fits; empty: a plain decode), the
    # proposer's own state, and what was drafted and accepted over the sequence's life.
    draft_token_ids: list[int] = field(default_factory=list)
    spec: Any = None
    num_drafted: int = 0
    num_accepted: int = 0
    # n > 1: choices 1..n-1 on choice 0 until its prompt is computed; in that step they sample
    # from its row and fork from it (Scheduler.update_from_output), sharing its blocks.
    forks: list[Sequence] = field(default_factory=list)
    # Beam search: the search it is a beam of (beam.BeamGroup), None otherwise.
    beam: Any = None

    @property
    def token_ids(self) -> TokenView:
        """Prompt then output, without copying either (sliceable, len())."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(
        self, tok: int, logprob: Any, eos_token_ids: list[int], max_model_len: int
    ) -> str | None:
        """Add a sampled token and end the sequence when it stops: its grammar is
        complete, a stop token or EOS (past min_tokens), max_tokens, or the model's
        context. Returns why its request must fail when its grammar refused the token."""
        self.output_token_ids.append(tok)
        self.new_token_ids.append(tok)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        p = self.params
        n_out = len(self.output_token_ids)
        complete = False  # a grammar that takes nothing more (its EOS included) ends it
        if self.matcher is not None:
            # (an errored matcher allows only EOS, and may take it: is_error says)
            if not self.matcher.consume_token(tok) or self.matcher.is_error():
                why = self.matcher.get_error() or "the grammar refused a token"
                return f"structured output failed: {why}"
            complete = self.matcher.is_stopped()
        if complete or (
            n_out >= p.min_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_token_ids))
        ):
            self.finish_reason = FINISH_STOP
        elif n_out >= p.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FINISH_LENGTH
        if self.finish_reason is not None:
            self.status = SeqStatus.FINISHED
            self.matcher = None
        return None

    def keep_samples(
        self, tokens: list[int], logprobs: list[Any], eos_token_ids: list[int], max_model_len: int
    ) -> tuple[int, int, tuple[str, str] | None]:
        """This step's samples at its rows (after its last token, then after each draft; -1
        where a row's sampling failed): the one sample-and-append. It keeps them up to and
        including the first that differs from its draft (every kept token is then a sample of
        the target's distribution at its position: the speculative package's docstring), each
        appended with its stops checked; a plain row, with no drafts, keeps its one sample.
        Returns (tokens kept, drafts matched, (error code, why) its request must fail, or None)."""
        drafts = self.draft_token_ids
        matched = 0
        while matched < len(drafts) and tokens[matched] == drafts[matched]:
            matched += 1
        kept = 0
        for tok, logprob in zip(tokens[: matched + 1], logprobs, strict=False):
            if tok < 0:
                return kept, matched, (ERR_INTERNAL, "sampling failed")
            kept += 1
            if error := self.append_token(tok, logprob, eos_token_ids, max_model_len):
                return kept, matched, (ERR_INVALID_REQUEST, error)
            if self.finished:
                break
        return kept, matched, None

    def end(self, reason: str) -> None:
        """Mark it finished with `reason` (its blocks are the scheduler's to free)."""
        if not self.finished:
            self.status = SeqStatus.FINISHED
            self.finish_reason = reason
        self.matcher = None
