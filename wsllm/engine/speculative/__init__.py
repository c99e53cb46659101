"""Speculative decoding: drafts proposed before the step, verified in it, exact.

The step calls three things (LLMEngine.step):

1. `propose(running)` before scheduling: each decoding sequence may get drafts
   (`Sequence.draft_token_ids`) from the proposer (`ngram`: its own earlier tokens;
   `draft`: a smaller model), as many as the policy finds worth their cost (policy.py).
   The scheduler runs a sequence with k drafts as one row of k + 1 tokens beside plain
   decodes and prompt chunks, and drops drafts that do not fit the budget or the free
   blocks. On the CPU such a row (at most 16 tokens) runs as decode rows of the fused
   decode stack: the same kernels, the same bits as one token at a time.
2. `verify(seqs, logits)` after the forward pass: the rows of sequences with drafts are
   sampled and accepted (verify.py); the others go on to the plain sampler.
3. `settle(scheduled)` before the scheduler advances: a sequence that kept n of its
   k + 1 tokens counts n computed; the blocks past its tokens (rejected drafts only) go
   back to the pool. Rejected tokens' slots are overwritten by the next tokens, and the
   prefix cache only indexes full blocks of computed, kept tokens.

Sequences that never draft: beam search (its own search over rows), embeddings, and
any row still computing its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.sampler import Sampler
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative.ngram import NgramProposer
from wsllm.engine.speculative.policy import Acceptance, StepCost, choose
from wsllm.engine.speculative.verify import verify

MODES = ("off", "ngram", "draft")


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
        proposer: Any,  # NgramProposer | DraftProposer | None (off)
        max_drafts: int,
        sampler: Sampler,
        eos_token_ids: list[int],
        max_model_len: int,
        adaptive: bool = True,
    ) -> None:
        self.proposer = proposer
        self.adaptive = adaptive  # False: every draft offered is verified (for measuring)
        self.max_drafts = max_drafts
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.cost = StepCost()
        self.stats = SpecStats()
        self._kept: dict[int, int] = {}  # seq_id -> tokens kept, this step

    def propose(self, running: list[Sequence], backlog: bool = False) -> None:
        """Give the running decodes their drafts for this step (most get none). `backlog`:
        requests wait for room in the batch (policy.choose says why that matters)."""
        if self.proposer is None:
            return
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
        ks = choose(most, rates, self.cost, decoding, backlog) if self.adaptive else most
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

    def verify(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor | None, list[tuple[Sequence, str, str]]]:
        """Take the rows of the sequences with drafts out of the batch, sample and accept
        them. Returns the other sequences, their logits, and the failed sequences."""
        self._kept.clear()
        if not any(s.draft_token_ids for s in seqs):
            return seqs, logits, []
        plain: list[int] = []
        drafting: list[int] = []
        mine: list[Sequence] = []
        rest: list[Sequence] = []
        row = 0
        for seq in seqs:
            n = 1 + len(seq.draft_token_ids)
            if n == 1:
                plain.append(row)
                rest.append(seq)
            else:
                drafting.extend(range(row, row + n))
                mine.append(seq)
            row += n
        kept, matched, bad = verify(
            self.sampler, mine, logits[drafting], self.eos_token_ids, self.max_model_len
        )
        for seq, n, m in zip(mine, kept, matched, strict=True):
            k = len(seq.draft_token_ids)
            if seq.spec is not None:
                seq.spec.acceptance.record(k, m)
            self.stats.drafted += k
            self.stats.accepted += min(m, n)
            self.stats.verifications += 1
            self._kept[seq.seq_id] = n
        return rest, (logits[plain] if plain else None), bad

    def settle(self, scheduled: list[tuple[Sequence, int]], bm: BlockManager) -> list[tuple[Sequence, int]]:
        """The scheduled tokens that count as computed: what each verifying sequence kept.
        Their blocks past their tokens (rejected drafts only) go back to the pool."""
        if self.proposer is not None:
            self.proposer.forget([seq.seq_id for seq, _ in scheduled if seq.finished])
        if not self._kept:
            return scheduled
        out = []
        for seq, n in scheduled:
            kept = self._kept.get(seq.seq_id)
            if kept is not None:
                n = kept
                seq.draft_token_ids.clear()
                if not seq.finished:
                    bm.trim(seq.seq_id, seq.num_tokens)
            out.append((seq, n))
        return out

    def observe_step(self, rows: int, decode_only: bool, seconds: float) -> None:
        """A step's time, for the cost model: decode-only steps, by their rows."""
        if decode_only and self.proposer is not None:
            self.cost.observe(rows, seconds * 1000.0)


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
    sampler: Sampler,
    eos_token_ids: list[int],
    max_model_len: int,
    draft_model: Any = None,  # --speculative draft: the model (draft.load_draft)
    num_tokens: int = 0,  # the target's KV cache, in tokens: the draft's holds as many
) -> Speculator:
    """The engine's speculator from its config (`--speculative`)."""
    proposer: Any = None
    if config.speculative == "ngram":
        proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    elif config.speculative == "draft":
        from wsllm.engine.speculative.draft import DraftProposer

        proposer = DraftProposer(draft_model, num_tokens, config.block_size)
    return Speculator(
        proposer,
        config.num_speculative_tokens,
        sampler,
        eos_token_ids,
        max_model_len,
        config.speculative_adaptive,
    )


__all__ = ["MODES", "Speculator", "SpecStats", "build"]
