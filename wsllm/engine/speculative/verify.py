"""Verification: which drafted tokens a sequence keeps, exactly as if it had not drafted.

A sequence that drafted d1..dk ran one row of k + 1 tokens (its last token, then the
drafts), so the model gave k + 1 next-token distributions: row i's is the one the sequence
would sample from had it accepted d1..di. Each row is sampled by the engine's own sampler,
as the sequence would stand at that row (`RowView`: its output extended by the drafts
before the row, so penalties, min_tokens, a grammar's state and a seeded row's noise are
those of that position). The sequence keeps the samples up to and including the first
that differs from its draft: d1..da, then the sample of row a (the target's own next
token where it rejected d(a+1), or a bonus token past the last draft).

This is the standard rejection rule for drafts proposed with certainty (q one-hot: both
proposers draft greedily): draft d is accepted with probability min(1, p(d) / q(d)) =
p(d), and on rejection the token comes from the normalised max(0, p - q), which is p
without d. Sampling row i from p with its own noise and accepting while the sample equals
the draft realises exactly that: the sample equals d with probability p(d), and given it
does not, it is distributed as p without d. Every kept token is therefore a sample of the
target's distribution at its position; greedy rows keep the target's argmax, so greedy
output is token for token what it is without speculation, and a seeded row (its noise
keyed by its output position) gives the same tokens with or without drafts.
"""

from __future__ import annotations

from typing import Any

import torch

from wsllm.engine.sampler import Sampler
from wsllm.engine.sequence import Sequence
from wsllm.types import ERR_INTERNAL, ERR_INVALID_REQUEST


class RowView:
    """A sequence as the sampler reads it at row `ahead` of its verification: as if it had
    accepted its first `ahead` drafts."""

    __slots__ = ("seq", "ahead", "matcher")

    def __init__(self, seq: Sequence, ahead: int, matcher: Any) -> None:
        self.seq, self.ahead, self.matcher = seq, ahead, matcher

    @property
    def params(self) -> Any:
        return self.seq.params

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def output_token_ids(self) -> list[int]:
        out = self.seq.output_token_ids
        return out + self.seq.draft_token_ids[: self.ahead] if self.ahead else out

    @property
    def token_ids(self) -> list[int]:
        return [*self.seq.token_ids, *self.seq.draft_token_ids[: self.ahead]]


def row_views(seq: Sequence) -> list[RowView]:
    """The k + 1 rows of a sequence verifying k drafts. A structured sequence's row i reads
    a copy of its grammar that has taken the first i drafts (the proposer cut the drafts at
    the first token the grammar refuses, so each copy takes them)."""
    drafts = seq.draft_token_ids
    views = [RowView(seq, 0, seq.matcher)]
    matcher = seq.matcher
    for i, tok in enumerate(drafts, start=1):
        if matcher is not None:
            matcher = matcher.deep_copy()
            matcher.consume_token(tok)
        views.append(RowView(seq, i, matcher))
    return views


def verify(
    sampler: Sampler,
    seqs: list[Sequence],
    logits: torch.Tensor,  # [sum of 1 + len(drafts), vocab]: each sequence's rows in order
    eos_token_ids: list[int],
    max_model_len: int,
) -> tuple[list[int], list[int], list[tuple[Sequence, str, str]]]:
    """Sample every row, keep each sequence's accepted tokens (appended, stops checked at
    each). Returns how many tokens each sequence kept, how many of its drafts matched the
    target's samples, and the sequences whose request must fail (code, why)."""
    views = [v for seq in seqs for v in row_views(seq)]
    result, failed = sampler.sample_isolated(logits, views)
    kept: list[int] = []
    matched: list[int] = []
    bad: list[tuple[Sequence, str, str]] = []
    row = 0
    for seq in seqs:
        drafts = seq.draft_token_ids
        k = len(drafts)
        sampled = result.token_ids[row : row + k + 1]
        accepted = 0
        while accepted < k and sampled[accepted] == drafts[accepted]:
            accepted += 1
        n = 0
        for j in range(accepted + 1):
            if row + j in failed:
                bad.append((seq, ERR_INTERNAL, failed[row + j]))
                break
            n += 1
            error = seq.append_token(sampled[j], result.logprobs[row + j], eos_token_ids, max_model_len)
            if error:
                bad.append((seq, ERR_INVALID_REQUEST, error))
                break
            if seq.finished:
                break
        seq.num_drafted += k
        seq.num_accepted += min(accepted, n)
        kept.append(n)
        matched.append(accepted)
        row += k + 1
    return kept, matched, bad
