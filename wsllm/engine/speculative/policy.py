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
  decoding sequence is a row; a verification of k drafts is k + 1), an average per row
  count, read between the counts seen (linear) and past the largest with the slope
  between the last two seen, never flatter than `PRIOR_SLOPE` of the largest's time per
  row. On a CPU a step's time grows with its rows (0.5-1 ms a row of SmolLM2 on two cores:
  docs/benchmarks.md), on a GPU hardly at all until the batch fills it.

The choice is greedy: start from every decoding sequence's one token a step, then add
the draft with the highest expected gain while (tokens + gain) / t(rows + 1) beats
tokens / t(rows). At 32 streams on a CPU a row costs about what a token is worth, so only
drafts nearly sure to be accepted ride; at one stream the step's fixed cost dominates and
several drafts pay even at modest acceptance.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PRIOR = 0.5  # a draft token's chance before a sequence has verified any
DECAY = 0.9  # per decoding step, on a sequence's counts
# Extrapolated cost of a row past the largest count seen, as a share of that step's time
# per row: optimistic enough to try a few drafts, which then measures the real cost.
PRIOR_SLOPE = 0.25
EMA = 0.2  # weight of the newest step in a row count's average time


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
    """Milliseconds of a decode-only step by its rows, as measured."""

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}

    def observe(self, rows: int, ms: float) -> None:
        old = self.ms.get(rows)
        self.ms[rows] = ms if old is None else old + EMA * (ms - old)

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows; None before any step was seen."""
        if not self.ms:
            return None
        if rows in self.ms:
            return self.ms[rows]
        seen = sorted(self.ms)
        below = [r for r in seen if r < rows]
        above = [r for r in seen if r > rows]
        if below and above:
            a, b = below[-1], above[0]
            return self.ms[a] + (self.ms[b] - self.ms[a]) * (rows - a) / (b - a)
        if not below:  # fewer rows than any seen: no cheaper than the smallest
            return self.ms[seen[0]] * rows / seen[0]
        top = seen[-1]
        slope = PRIOR_SLOPE * self.ms[top] / top
        if len(seen) > 1:
            prev = seen[-2]
            slope = max(slope, (self.ms[top] - self.ms[prev]) / (top - prev))
        return self.ms[top] + slope * (rows - top)


def choose(most: list[int], rates: list[float], cost: StepCost, rows: int) -> list[int]:
    """How many drafts each sequence verifies (at most most[i], each accepted with chance
    rates[i]), in a step of `rows` rows without drafts, one token expected per row."""
    ks = [0] * len(most)
    now = cost(rows)
    if now is None:  # nothing measured yet: one plain step first
        return ks
    tokens = float(rows)
    heap = [(-rates[i], i) for i in range(len(most)) if most[i] > 0 and rates[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        after = cost(rows + 1)
        assert after is not None
        if (tokens - neg_gain) * now <= tokens * after:
            break  # the best draft left no longer pays for its row
        tokens -= neg_gain
        rows += 1
        now = after
        ks[i] += 1
        if ks[i] < most[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))
    return ks
