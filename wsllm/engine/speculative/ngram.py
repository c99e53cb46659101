"""N-gram prompt lookup: a sequence's next tokens guessed from its own earlier tokens.

Where an answer quotes its input (code edited, a paragraph rewritten, a record filled from
a pasted text), the last few tokens of a sequence have usually appeared before, prompt or
output, and what followed them then is what follows now. The proposer looks up the
sequence's last `n` tokens (the longest n from `n_max` down to `n_min` that has occurred
before) and proposes the tokens that followed their latest earlier occurrence.

The index is built once per sequence and kept up to date a token at a time: a dict from
each n-gram (a tuple of n token ids) to where its latest occurrence's continuation starts.
A lookup and a step's update cost a few dict operations, whatever the context's length;
the prompt's n-grams are indexed the first time the sequence decodes.
"""

from __future__ import annotations

from wsllm.engine.sequence import Sequence


class NgramIndex:
    """One sequence's n-grams -> the position that followed their latest occurrence."""

    __slots__ = ("follows", "indexed")

    def __init__(self) -> None:
        self.follows: dict[tuple[int, ...], int] = {}
        # continuations [0, indexed) are in the index: each n-gram that ends before them
        self.indexed = 0

    def update(self, seq: Sequence, n_min: int, n_max: int) -> None:
        """Index every n-gram whose continuation is a token the sequence has now, except
        its current suffix (whose continuation is what we are looking for)."""
        total = seq.num_tokens
        if self.indexed >= total:
            return
        first = max(self.indexed, n_min)
        base = max(0, first - n_max)
        tokens = seq.token_ids[base:total]  # only the tail that new n-grams read
        follows = self.follows
        for j in range(first, total):  # j: where the continuation starts
            for n in range(n_min, min(n_max, j) + 1):
                follows[tuple(tokens[j - n - base : j - base])] = j
        self.indexed = total

    def propose(self, seq: Sequence, k: int, n_min: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's
        longest matching suffix; [] when no suffix of n_min tokens or more occurred before.
        Where that continuation runs into the suffix itself (a loop: the sequence repeats
        its last `period` tokens), it goes on around the loop."""
        total = seq.num_tokens
        tail = seq.token_ids[max(0, total - n_max) : total]
        for n in range(min(n_max, len(tail)), n_min - 1, -1):
            at = self.follows.get(tuple(tail[len(tail) - n :]))
            if at is None:
                continue
            if at + k <= total:
                return seq.token_ids[at : at + k]
            loop = seq.token_ids[at:total]
            return [loop[i % len(loop)] for i in range(k)]
        return []


class NgramProposer:
    """`--speculative ngram`: drafts from each sequence's own tokens (no model). Cheap
    enough to propose the most for every sequence before the policy picks how many."""

    cheap = True

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], most: list[int]) -> list[list[int]]:
        """Up to most[i] tokens for each of `seqs` (decoding sequences)."""
        out = []
        for seq, k in zip(seqs, most, strict=True):
            index = seq.spec.proposer
            if index is None:
                index = seq.spec.proposer = NgramIndex()
            index.update(seq, self.n_min, self.n_max)
            out.append(index.propose(seq, k, self.n_min, self.n_max) if k > 0 else [])
        return out

    def release(self, alive: set[int]) -> None:
        """Nothing to free: each index lives on its sequence (Sequence.spec)."""

    def forget(self, seq_ids: list[int]) -> None:
        """Nothing to free (see release)."""
