"""How many drafts each sequence verifies in a step: none where they would cost.

A draft token is worth verifying when the tokens it is expected to add per unit of step
time beat what the step already gives. Two estimates feed that:

- **Acceptance**, per sequence: the chance that its next draft token is accepted, `a`,
  kept as decayed counts of accepted drafts and trials (each verification is `accepted`
  successes and, if it stopped at a rejection, one failure), pulled toward a prior of
  `PRIOR` with the weight of one trial. The counts decay at every step the sequence
  decodes, drafting or not, so a sequence that stopped drafting drifts back toward the
  prior and tries again when the step's cost allows it. Under that model the i-th draft is
  accepted (the previous ones with it) with chance `a ** i`.
- **Step cost**, measured: the wall time of decode-only steps by the rows they ran (a
  decoding sequence is a row; a verification of k drafts is k + 1), the median of each row
  count's recent steps (StepCost: robust to a slow step), read between the counts seen
  (linear) and past the largest with the slope between the last two seen, never flatter
  than `PRIOR_SLOPE` of the largest's time per row. On a CPU a step's time grows with its
  rows (0.5-1 ms a row of SmolLM2 on two cores: docs/speculative.md), on a GPU hardly at
  all until the batch fills it.

The choice: the drafts in order of expected gain, and of every leading run of that order
the one that gives the most expected tokens per millisecond of step (`choose`). At 32 streams on a CPU a row costs about what a token is worth, so only
drafts nearly sure to be accepted ride; at one stream the step's fixed cost dominates and
several drafts pay even at modest acceptance.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PRIOR = 0.5  # a draft token's chance before a sequence has verified any
DECAY = 0.9  # per decoding step, on a sequence's counts
# Extrapolated cost of a row past the largest count seen, as a share of that step's time
# per row: optimistic enough to try a few drafts, which then measures the real cost.
PRIOR_SLOPE = 0.25
SAMPLES = 8  # steps kept per row count; their median is its time
TRUSTED = 3  # samples before a row count's median stands on its own
STALE = 500  # decode-only steps after which a row count not seen again is forgotten


@dataclass(slots=True)
class Acceptance:
    """One sequence's decayed counts of accepted drafts and of trials."""

    accepted: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR) / (self.trials + 1.0)

    def decay(self) -> None:
        self.accepted *= DECAY
        self.trials *= DECAY

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.trials += accepted + (accepted < drafted)


class StepCost:
    """Milliseconds of a decode-only step by its rows, as measured: the median of each row
    count's last `SAMPLES` steps. A count with fewer than `TRUSTED` samples is read as the
    lower of its samples' median and what the trusted counts say of it, so that one slow step
    (a collection, a neighbour's burst) never makes drafting look dear where no later step
    would come to correct it; a count not seen for `STALE` decode-only steps is forgotten."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._seen: dict[int, int] = {}  # rows -> the observation that last saw them
        self._count = 0

    def observe(self, rows: int, ms: float) -> None:
        self._count += 1
        self._samples.setdefault(rows, deque(maxlen=SAMPLES)).append(ms)
        self._seen[rows] = self._count
        if self._count % STALE == 0:
            for r in [r for r, at in self._seen.items() if self._count - at > STALE]:
                del self._samples[r], self._seen[r]

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows; None before any step was seen."""
        return self.snapshot()(rows)

    def snapshot(self) -> Callable[[int], float | None]:
        """The expected time by rows, as the steps so far say (computed once for many reads)."""
        medians = {r: statistics.median(q) for r, q in self._samples.items()}
        trusted = {r: m for r, m in medians.items() if len(self._samples[r]) >= TRUSTED}
        few = {r: m for r, m in medians.items() if r not in trusted}
        counts = sorted(trusted) if trusted else sorted(medians)
        table = trusted if trusted else medians

        def read(rows: int) -> float | None:
            model = _read(table, counts, rows)
            mine = few.get(rows)
            if mine is not None and trusted:
                return mine if model is None else min(mine, model)
            return model

        return read


def _read(ms: dict[int, float], seen: list[int], rows: int) -> float | None:
    """`rows` read off the measured counts (`seen`: ms's keys, sorted): linear between two,
    past the largest with the slope between the last two (never flatter than PRIOR_SLOPE of
    its time per row), below the smallest in proportion."""
    if not ms:
        return None
    if rows in ms:
        return ms[rows]
    at = bisect.bisect(seen, rows)
    if 0 < at < len(seen):
        a, b = seen[at - 1], seen[at]
        return ms[a] + (ms[b] - ms[a]) * (rows - a) / (b - a)
    if at == 0:  # fewer rows than any seen: no cheaper than the smallest, per row
        return ms[seen[0]] * rows / seen[0]
    top = seen[-1]
    slope = PRIOR_SLOPE * ms[top] / top
    if len(seen) > 1:
        prev = seen[-2]
        slope = max(slope, (ms[top] - ms[prev]) / (top - prev))
    return ms[top] + slope * (rows - top)


def choose(most: list[int], rates: list[float], cost: StepCost, rows: int) -> list[int]:
    """How many drafts each sequence verifies (at most most[i], each accepted with chance
    rates[i]), in a step of `rows` rows without drafts, one token expected per row.

    The drafts in order of expected gain (a sequence's i-th after its first i - 1, so each
    sequence's drafts stay a prefix); of every leading run of that order, the one with the
    most tokens per millisecond. Not the first run that stops paying: a step's time is not
    convex in its rows (on the CPU two rows can cost more than three), so one dear row can
    hide cheaper ones past it."""
    read = cost.snapshot()
    base = read(rows)
    if base is None:  # nothing measured yet: one plain step first
        return [0] * len(most)
    order: list[int] = []  # sequence of each draft, best first
    heap = [(-rates[i], i) for i in range(len(most)) if most[i] > 0 and rates[i] > 0]
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
        if taken[i] < most[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))
    ks = [0] * len(most)
    for i in order[:best_n]:
        ks[i] += 1
    return ks
