"""One request inside the engine: its choices (sequences; choices 1..n-1 wait on choice 0 to
fork from it, `Sequence.forks`), its beam search, and its prompt logprobs as the steps compute them. It builds its own
step output; the engine decides when.

Prompt logprobs: the model runner computes them a prompt chunk at a time
(`PromptLogprobs`); the request keeps them in prompt order until every prompt token
has its entry, then hands them over once, with the output of that step.

Pooling (`params.pooling`, an embedding request): the model runner hands over each
chunk's sum of hidden states (`mean`) or the last row (`last`); the request adds the
chunks up in prompt order and keeps the vector once its prompt is computed. A recompute
after preemption starts the sum over; mean pooling never takes prefix-cache hits
(`SamplingParams.needs_every_position`), so every position is summed here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from wsllm.engine.beam import BeamGroup, BeamState
from wsllm.engine.outputs import CompletionOutput, RequestOutput
from wsllm.engine.sequence import Sequence
from wsllm.types import FINISH_LENGTH, FINISH_STOP, SamplingParams


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    beam: BeamGroup | None = None  # its running beams are `seqs`
    # queue time goes on the request's first output after its first schedule, only
    reported_queue_time: bool = False
    # params.prompt_logprobs: per prompt token so far ([None] for the first); None when not
    # asked for or once reported
    prompt_logprobs: list[Any] | None = None
    # pooling: the sum of the hidden states computed so far ([hidden] fp32) and its positions
    pool_sum: torch.Tensor | None = None
    pool_count: int = 0
    embedding: list[float] | None = None  # pooling: the vector, once the prompt is computed

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @classmethod
    def start(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int,
        tenant: str,
        eos_token_ids: list[int],
    ) -> Request:
        """A new request and its choices. Its first sequence goes to the scheduler;
        choices 1..n-1 wait on it (`forks`) to fork from it once its prompt is computed,
        and a beam search starts from that one sequence."""
        req = cls(request_id, list(prompt_token_ids), params)
        req.seqs = [
            Sequence(
                request_id, i, req.prompt_token_ids, params, arrival_time, priority=priority, tenant=tenant
            )
            for i in range(params.n)
        ]
        if params.use_beam_search:
            req.seqs = req.seqs[:1]
            eos = [] if params.ignore_eos else eos_token_ids
            state = BeamState(
                params.beam_width, params.length_penalty, params.early_stopping, params.max_tokens, eos
            )
            req.beam = req.seqs[0].beam = BeamGroup(state, req.seqs)
        else:
            req.seqs[0].forks = req.seqs[1:]
        return req

    @property
    def pending(self) -> list[Sequence]:
        """The choices not forked yet."""
        return self.seqs[0].forks

    # -- prompt logprobs ---------------------------------------------------------
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt token still lacks its logprob entry."""
        plp = self.prompt_logprobs
        return plp is not None and len(plp) < len(self.prompt_token_ids)

    def keep_prompt_logprobs(self, first: int, entries: list[Any]) -> None:
        """The entries of prompt positions first, first + 1, ... from one step."""
        plp = self.prompt_logprobs
        if plp is None:
            return
        have = len(plp)
        if first <= have:  # a recompute after preemption repeats the ones it has
            plp += entries[have - first :]

    def take_prompt_logprobs(self) -> list[Any] | None:
        """The prompt logprobs, once, when every prompt token has its entry."""
        if self.prompt_logprobs is None or self.wants_prompt_logprobs():
            return None
        plp, self.prompt_logprobs = self.prompt_logprobs, None
        return plp

    # -- pooling -----------------------------------------------------------------
    def keep_pooled(self, start: int, num_tokens: int, vector: torch.Tensor, caught_up: bool) -> bool:
        """One step's pooled chunk over positions [start, start + num_tokens); True when
        it completes the embedding."""
        if self.params.pooling == "mean":
            if start == 0:  # the first chunk, or a recompute after preemption: start over
                self.pool_sum, self.pool_count = None, 0
            self.pool_sum = vector if self.pool_sum is None else self.pool_sum + vector
            self.pool_count += num_tokens
            if caught_up:
                self.embedding = (self.pool_sum / self.pool_count).tolist()
        elif caught_up:  # last
            self.embedding = vector.tolist()
        return caught_up

    # -- outputs -----------------------------------------------------------------
    def output(self) -> RequestOutput:
        """What this step produced for every choice; clears the per-step tokens."""
        comps = []
        for s in self.seqs:
            comps.append(
                CompletionOutput(
                    s.index,
                    s.new_token_ids,
                    len(s.output_token_ids),
                    s.finish_reason,
                    s.new_logprobs if s.params.logprobs is not None else None,
                    list(s.output_token_ids) if s.finished else [],
                )
            )
            s.new_token_ids = []
            s.new_logprobs = []
        qt = None
        first = self.seqs[0]
        if not self.reported_queue_time and first.first_scheduled_time is not None:
            qt = max(0.0, first.first_scheduled_time - first.arrival_time)
            self.reported_queue_time = True
        return self._output(comps, all(s.finished for s in self.seqs), qt)

    def beam_output(self) -> RequestOutput:
        """The whole answer of a finished beam search: its best `n` hypotheses."""
        assert self.beam is not None
        comps = [
            CompletionOutput(
                i,
                list(h.token_ids),
                len(h.token_ids),
                FINISH_STOP if h.stopped_by_eos else FINISH_LENGTH,
                token_ids=h.token_ids,
            )
            for i, h in enumerate(self.beam.state.best(self.params.n))
        ]
        first = self.seqs[0]
        qt = max(0.0, (first.first_scheduled_time or first.arrival_time) - first.arrival_time)
        return self._output(comps, True, qt)

    def _output(self, comps: list[CompletionOutput], finished: bool, qt: float | None) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            len(self.prompt_token_ids),
            comps,
            finished,
            self.seqs[0].num_cached_tokens,
            qt,
            prompt_logprobs=self.take_prompt_logprobs(),
            embedding=self.embedding,
            num_drafted=sum(s.num_drafted for s in self.seqs),
            num_accepted=sum(s.num_accepted for s in self.seqs),
        )
