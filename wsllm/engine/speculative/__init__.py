"""Speculative decoding: drafts proposed before the step, verified in it, exact.

The step calls the speculator twice (LLMEngine.step):

1. `propose(running)` before scheduling: each decoding sequence may get drafts
   (`Sequence.draft_token_ids`) from the proposer (`ngram`: its own earlier tokens;
   `draft`: a smaller model), as many as the policy finds worth their cost (policy.py,
   reading the engine's one step-cost model). The scheduler runs a sequence with k drafts as
   one row of k + 1 tokens beside plain decodes and prompt chunks, and drops drafts that do
   not fit the budget or the free blocks. On the CPU such a row (at most 16 tokens) runs as
   decode rows of the fused decode stack: the same kernels, the same bits as one token at a time.
2. `record(update)` once the scheduler took the step's output: each verification's
   acceptance, for the policy, and the counters.

Verification itself is no step of its own: the token stage samples a drafting sequence's k + 1
rows as any others (sampler.py: row i as if it had accepted i drafts), and
`Scheduler.update_from_output` keeps the samples up to and including the first that differs
from its draft. That is the standard rejection rule for drafts proposed with certainty (q
one-hot: both proposers draft greedily): draft d is accepted with probability min(1, p(d) /
q(d)) = p(d), and on rejection the token comes from the normalised max(0, p - q), which is p
without d. Sampling row i from p with its own noise and accepting while the sample equals the
draft realises exactly that: the sample equals d with probability p(d), and given it does not,
it is distributed as p without d. Every kept token is therefore a sample of the target's
distribution at its position; greedy rows keep the target's argmax, so greedy output is token
for token what it is without speculation, and a seeded row (its noise keyed by its output
position) gives the same tokens with or without drafts. A sequence that kept n of its k + 1
tokens counts n computed; the blocks past its tokens (rejected drafts only) go back to the
pool; rejected tokens' slots are overwritten by the next tokens, and the prefix cache only
indexes full blocks of computed, kept tokens.

Sequences that never draft: beam search (its own search over rows), embeddings, and
any row still computing its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from wsllm.engine.scheduler import Scheduler, StepUpdate
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative.ngram import NgramProposer
from wsllm.engine.speculative.policy import Acceptance, choose
from wsllm.engine.step_cost import StepCost

MODES = ("off", "ngram", "draft")


class Proposer(Protocol):
    """What a proposer of drafts gives the speculator."""

    #: proposing the most for every sequence is cheap (n-gram): the policy then keeps what pays;
    #: else (a draft model) the policy picks each sequence's count first and only those are drafted
    cheap: bool

    def propose(self, seqs: list[Sequence], most: list[int]) -> list[list[int]]: ...
    def release(self, alive: set[int]) -> None: ...
    def forget(self, seq_ids: list[int]) -> None: ...


@dataclass(slots=True)
class SeqSpec:
    """Speculation's state on a sequence (Sequence.spec)."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    proposer: Any = None  # the proposer's own: an NgramIndex, a draft-model sequence


@dataclass(slots=True)
class SpecStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, kept
    verifications: int = 0  # rows that verified drafts (a sequence in a step)


class Speculator:
    def __init__(
        self,
        proposer: Proposer | None,  # None: off
        max_drafts: int,
        eos_token_ids: list[int],
        max_model_len: int,
        cost: StepCost,  # the engine's step-cost model
        adaptive: bool = True,
    ) -> None:
        self.proposer = proposer
        self.adaptive = adaptive  # False: every draft offered is verified (for measuring)
        self.max_drafts = max_drafts
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.cost = cost
        self.stats = SpecStats()

    def propose(self, scheduler: Scheduler) -> None:
        """Give the running decodes their drafts for this step (most get none). Whether
        requests wait for room in the batch matters (policy.choose says why)."""
        if self.proposer is None:
            return
        running, backlog = scheduler.running, scheduler.has_backlog()
        seqs: list[Sequence] = []
        most: list[int] = []
        decoding = 0
        for seq in running:
            seq.draft_token_ids.clear()
            if seq.num_uncomputed != 1 or seq.finished:
                continue
            decoding += 1
            p = seq.params
            if p.use_beam_search or p.pooling:
                continue
            if seq.spec is None:
                seq.spec = SeqSpec()
            seq.spec.acceptance.decay()
            left = min(p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            if left > 0:
                seqs.append(seq)
                most.append(min(self.max_drafts, left))
        self.proposer.release({s.seq_id for s in running})
        if not seqs:
            return
        whole = backlog or decoding == 1 or not self.adaptive  # else every decoding row must draft
        if not whole and len(seqs) < decoding:
            return  # a sequence that cannot draft decodes: the batch waits for it anyway
        if self.proposer.cheap:  # propose the most, then keep what pays
            drafts = self._cheap_drafts(seqs, most, whole)
            if drafts is None:
                return
            most = [len(d) for d in drafts]
        rates = [s.spec.acceptance.rates for s in seqs]
        ks = choose(most, rates, self.cost.decode_rows(), decoding, backlog) if self.adaptive else most
        if not self.proposer.cheap:  # propose only what pays
            drafts = _cut(seqs, self.proposer.propose(seqs, ks), self.eos_token_ids)
        for seq, d, k in zip(seqs, drafts, ks, strict=True):
            seq.draft_token_ids[:] = d[:k]

    def _cheap_drafts(self, seqs: list[Sequence], most: list[int], whole: bool) -> list[list[int]] | None:
        """The proposer's drafts for `seqs`; unless `whole`, None at the first sequence with
        none (without a backlog nobody drafts then: policy.choose), proposing no further."""
        if whole:
            return _cut(seqs, self.proposer.propose(seqs, most), self.eos_token_ids)
        drafts = []
        for seq, m in zip(seqs, most, strict=True):
            d = _cut([seq], self.proposer.propose([seq], [m]), self.eos_token_ids)[0]
            if not d:
                return None
            drafts.append(d)
        return drafts

    def record(self, update: StepUpdate, finished: list[Sequence]) -> None:
        """After the scheduler took the step's output: each verification's acceptance and the
        counters; the proposer's state of the sequences that finished goes."""
        if self.proposer is not None:
            self.proposer.forget([seq.seq_id for seq in finished])
        for seq, k, matched, accepted in update.verified:
            if seq.spec is not None:
                seq.spec.acceptance.record(k, matched)
            self.stats.drafted += k
            self.stats.accepted += accepted
            self.stats.verifications += 1


def _cut(seqs: list[Sequence], drafts: list[list[int]], eos_token_ids: list[int]) -> list[list[int]]:
    """Drafts end at the first token that would stop the sequence (nothing after it could
    be kept) and, for a structured sequence, before the first token its grammar refuses."""
    for i, seq in enumerate(seqs):
        d, p = drafts[i], seq.params
        if not d:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for j, tok in enumerate(d):
            if tok in stops:
                d = d[: j + 1]
                break
        if seq.matcher is not None:
            d = d[: seq.matcher.validate_tokens(d)]
        drafts[i] = d
    return drafts


def build(
    config: Any,
    cost: StepCost,
    eos_token_ids: list[int],
    max_model_len: int,
    draft_model: Any = None,  # --speculative draft: the model (draft.load_draft)
    num_tokens: int = 0,  # the target's KV cache, in tokens: the draft's holds as many
) -> Speculator:
    """The engine's speculator from its config (`--speculative`)."""
    proposer: Proposer | None = None
    if config.speculative == "ngram":
        proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    elif config.speculative == "draft":
        from wsllm.engine.speculative.draft import DraftProposer

        proposer = DraftProposer(draft_model, num_tokens, config.block_size)
    return Speculator(
        proposer,
        config.num_speculative_tokens,
        eos_token_ids,
        max_model_len,
        cost,
        config.speculative_adaptive,
    )


__all__ = ["MODES", "Proposer", "Speculator", "SpecStats", "build"]
