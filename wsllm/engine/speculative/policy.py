"""How many drafts each sequence verifies in a step: none where they would cost.

A draft token is worth verifying when the tokens it is expected to add per unit of step
time beat what the step already gives. Two estimates feed that:

- **Acceptance**, per sequence, as two chances: that its first draft token is accepted,
  and that a draft token after an accepted one is (quoted text is accepted in runs: once a
  draft has met the copy, the rest of it mostly follows; in a probe on quoting prompts 89%
  of the 8-token drafts the policy chose were accepted whole, where one chance for every
  token had predicted 0.85 ** 8 = 27%). Each is kept as decayed counts of successes and
  trials, pulled toward its prior (`PRIOR_FIRST`, `PRIOR_NEXT`) with the weight of one
  trial. The counts decay at every step the sequence decodes, drafting or not, so a
  sequence that stopped drafting drifts back toward the priors and tries again when the
  step's cost allows it. The i-th draft is accepted (with those before it) with chance
  `first * next ** (i - 1)`.
- **Step cost**, measured: the wall time of decode-only steps by the rows they ran, as the
  engine's one step-cost model keeps it (step_cost.py, `StepCost.decode_rows`).

The choice (`choose`) maximises expected tokens per millisecond of step: the batch's own
when requests wait for room (each sequence that ends sooner lets the next in), else the
slowest sequence's (the batch ends with it). At one stream the step's fixed cost dominates
and several drafts pay even at modest acceptance; at 32 streams a row costs a good part of
what a token is worth, and while any of them has nothing to draft, nobody drafts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_FIRST = 0.5  # a sequence's first draft token's chance, before it has verified any
PRIOR_NEXT = 0.7  # a draft token's chance after an accepted one, likewise
DECAY = 0.9  # per decoding step, on a sequence's counts
LOOK_PAST = 16  # drafts tried past the best run so far before the choice stops looking


@dataclass(slots=True)
class Acceptance:
    """One sequence's decayed counts: first draft tokens accepted and tried, draft tokens
    after an accepted one accepted and tried."""

    first: float = 0.0
    first_trials: float = 0.0
    next: float = 0.0
    next_trials: float = 0.0

    @property
    def rates(self) -> tuple[float, float]:
        """(the first draft's chance, a later draft's chance once the one before it is accepted)"""
        return (self.first + PRIOR_FIRST) / (self.first_trials + 1.0), (self.next + PRIOR_NEXT) / (
            self.next_trials + 1.0
        )

    def decay(self) -> None:
        self.first *= DECAY
        self.first_trials *= DECAY
        self.next *= DECAY
        self.next_trials *= DECAY

    def record(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens whose first `accepted` were accepted."""
        self.first_trials += 1
        self.first += accepted > 0
        self.next_trials += max(0, min(accepted + 1, drafted) - 1)  # positions 2.. that were tried
        self.next += max(0, accepted - 1)


def choose(
    most: list[int],
    rates: list[tuple[float, float]],
    read: Callable[[int], float | None],  # a decode-only step's ms by its rows (StepCost.decode_rows)
    rows: int,
    backlog: bool = True,
) -> list[int]:
    """How many drafts each sequence verifies (at most most[i]; rates[i]: the chance its first
    draft is accepted, and a later one once the one before is), in a step of `rows` rows
    without drafts (one per decoding sequence; those not in `most` cannot draft).

    With a `backlog` (requests wait for room), a sequence that finishes sooner lets the next
    one in, so every accepted token counts: the most expected tokens per millisecond. Without
    one, the batch runs until its slowest sequence ends, and a draft shortens the batch only
    as far as it shortens the slowest: the most expected tokens per millisecond of the
    sequence that gains least. So while a decoding sequence has nothing to draft, no other
    drafts at all (at 32 streams of free text its drafts only made every step dearer)."""
    base = read(rows)
    if base is None:  # nothing measured yet: one plain step first
        return [0] * len(most)
    if backlog:
        return _most_tokens(most, rates, read, rows, base)
    if len(most) < rows or min(most, default=0) == 0:
        return [0] * len(most)
    return _slowest_fastest(most, rates, read, rows, base)


def _most_tokens(
    most: list[int],
    rates: list[tuple[float, float]],
    read: Callable[[int], float | None],
    rows: int,
    base: float,
) -> list[int]:
    """The drafts in order of expected gain (a sequence's i-th after its first i - 1, so its
    drafts stay a prefix); of every leading run of that order, the one with the most tokens
    per millisecond. Not the first run that stops paying: a step's time is not convex in its
    rows (on the CPU two rows can cost more than three), so one dear row can hide cheaper
    ones past it."""
    order: list[int] = []  # sequence of each draft, best first
    heap = [(-rates[i][0], i) for i in range(len(most)) if most[i] > 0 and rates[i][0] > 0]
    heapq.heapify(heap)
    taken = [0] * len(most)
    best_rate, best_n, tokens = rows / base, 0, float(rows)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        order.append(i)
        taken[i] += 1
        tokens -= neg_gain
        t = read(rows + len(order))
        if t is not None and tokens / t > best_rate:
            best_rate, best_n = tokens / t, len(order)
        elif len(order) - best_n > LOOK_PAST:
            break  # far past the best run: what is left gains less and costs more
        if taken[i] < most[i]:
            heapq.heappush(heap, (neg_gain * rates[i][1], i))
    ks = [0] * len(most)
    for i in order[:best_n]:
        ks[i] += 1
    return ks


def _slowest_fastest(
    most: list[int],
    rates: list[tuple[float, float]],
    read: Callable[[int], float | None],
    rows: int,
    base: float,
) -> list[int]:
    """Drafts given one at a time to the sequence expected to gain least so far; of every
    such run, the one with the most expected tokens per millisecond for that sequence."""
    ks = [0] * len(most)
    gains = [1.0] * len(most)  # expected tokens this step, per sequence
    heap = [(1.0, i) for i in range(len(most))]
    best_rate, best_ks, n = 1.0 / base, list(ks), 0
    while heap:
        _, i = heapq.heappop(heap)
        if ks[i] >= most[i]:
            break  # the slowest can gain no more: neither can the batch
        first, after = rates[i]
        gains[i] += first * after ** ks[i]
        ks[i] += 1
        n += 1
        heapq.heappush(heap, (gains[i], i))
        t = read(rows + n)
        if t is not None and heap[0][0] / t > best_rate:
            best_rate, best_ks = heap[0][0] / t, list(ks)
        elif n - sum(best_ks) > LOOK_PAST:
            break
    return best_ks
