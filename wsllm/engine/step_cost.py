"""The step-cost model: what a step costs, by what it runs, as the steps so far measured.

One model, observed once per step (`LLMEngine.step`), read by the scheduler's pacing (how much
prompt work a step may take) and by speculative decoding's policy (how many drafts pay). Two
kinds of work make a step's time:

- **Decode rows**: a decoding sequence is a row, a verification of k drafts k + 1. Decode-only
  steps are kept by their rows, the median of each row count's recent steps (`DecodeRows`:
  robust to one slow step), read between the counts seen (linear) and past the largest with
  the slope between the last two seen, never flatter than `PRIOR_SLOPE` of the largest's time
  per row. On a CPU a step's time grows with its rows (0.5-1 ms a row of SmolLM2 on two cores:
  docs/speculative.md), on a GPU hardly at all until the batch fills it.
- **Prompt work**, priced in units (`price`): a prompt token is one unit plus the context its
  attention reads, `(context before it) / span`, where `span` is the context at which a token's
  attention costs about what the rest of its forward does (`attention_span`, from the model's
  shapes); a prompt-logprobs row adds `prompt_logprob_cost` (its LM-head row and the passes over
  its logits). A chunk of n tokens after c computed ones costs n (1 + (c + (n - 1) / 2) / span):
  the 2,048-token chunks of one 8,000-token prompt on the bundled model took 3.5, 6.1, 9.1 and
  10.6 s where a price by tokens alone said they were equal. A unit's milliseconds are measured
  (a moving average, `ALPHA`) from steps with prompt work: beside decodes (their share, the
  median decode-only step, taken out; forgotten after `DECODE_SAMPLES` decode-only steps in a
  row, as the next prompt comes with other load) and alone (kept: what a lone prompt's next chunk
  costs).

What the scheduler reads (`prompt_units`): the priced units that fit beside decodes in
`prefill_ms_while_decoding` or a decode-only step's time, whichever is longer (a long prompt at
most about doubles the streams' gap; a large batch, whose steps are long anyway, still takes
new prompts in about as fast: bench/amplification.py), and alone in `prefill_ms_alone` (a long
prompt's steps stay short: the watchdog's, and those who arrive next). Beside decodes already
measured, the first prompt step with no unit cost yet takes the floor (`MIN_UNITS` budget tokens:
a prompt always progresses); alone, `PROBE_UNITS`, never below `ALONE_MIN_UNITS`; with nothing
measured beside, the token cap.
Torch-free.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Prompt budget units a step that decodes always allows (a prompt always progresses): 8 tokens,
# or 4 prompt-logprobs rows. At a context of 1,500 on 2 AVX2 cores a SmolLM2 prompt token costs
# ~6 ms beside 16 decodes, so the floor, not the target, bounds such steps: 16 units made them
# ~3x a decode-only step, 8 about 2x (bench/amplification.py, docs/benchmarks.md).
MIN_UNITS = 8
# Budget tokens a step of prompts alone always allows: a batch of short prompts is never cut by
# time (their first tokens come together), and at the bundled model's context limit 256 tokens
# stay well under 2 s of two CPU cores (8,000-token probe: ~5.5 ms a token at a context of 7,700).
ALONE_MIN_UNITS = 256
# Priced units of the first prompt step alone whose unit cost is not known yet: a step of unknown
# cost is a moderate one, and it measures the unit for the next.
PROBE_UNITS = 512
# Weight of the newest step in the moving average of a unit's cost: a long prompt's next
# chunk costs about what its last one did, so the newest counts for half.
ALPHA = 0.5
# Decode-only steps whose median is the decodes' share of a step; as many in a row forget the
# unit's cost beside decodes (the next prompt comes with other work on the machine: the first
# chunk after a quiet stretch takes the floor and measures it again).
DECODE_SAMPLES = 15
# Attention is read at about this share of the matmuls' rate (a CPU's paged decode attention
# against its packed GEMMs; the measured unit cost absorbs the rest).
ATTENTION_EFFICIENCY = 0.5
# Extrapolated cost of a row past the largest count seen, as a share of that step's time
# per row: optimistic enough to try a few drafts, which then measures the real cost.
PRIOR_SLOPE = 0.25
SAMPLES = 8  # steps kept per row count; their median is its time
TRUSTED = 3  # samples before a row count's median stands on its own
STALE = 500  # decode-only steps after which a row count not seen again is forgotten


def attention_span(mc: Any) -> float:
    """The context (tokens) at which a token's attention reads cost about as much as the rest of
    its forward: its matmuls' multiply-adds over its attention's per token of context (q.k and
    p.v over every head of every layer), at `ATTENTION_EFFICIENCY`. SmolLM2-135M: ~1,500."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    linear = 2 * h * q + 2 * h * kv + 3 * h * mc.intermediate_size  # per token per layer
    return max(1.0, ATTENTION_EFFICIENCY * linear / (2 * q))


@dataclass(slots=True)
class StepWork:
    """What a step ran, as the cost model prices it (SchedulerOutput fills it)."""

    prefill_units: float = 0.0  # priced prompt work (`StepCost.price`)
    num_decodes: int = 0  # decoding sequences
    rows: int = 0  # decode rows: a decode 1, a verification of k drafts k + 1


class StepCost:
    """Estimates from the steps run (see the module's docstring)."""

    def __init__(
        self,
        prefill_ms_while_decoding: float = 0.0,  # 0: no time bound beside decodes
        prefill_ms_alone: float = 0.0,  # 0: no time bound on a prompt's step alone
        span: float = math.inf,  # attention_span; inf: tokens alone
        prompt_logprob_cost: float = 0.0,
    ) -> None:
        self.target_ms = prefill_ms_while_decoding
        self.alone_ms = prefill_ms_alone
        self.span = span
        self.prompt_logprob_cost = prompt_logprob_cost
        self.rows = DecodeRows()
        self._decodes: deque[float] = deque(maxlen=DECODE_SAMPLES)  # decode-only steps' ms
        self.ms_per_unit: float | None = None  # beside decodes
        self.ms_per_unit_alone: float | None = None
        self._quiet = 0  # decode-only steps since the last with prompt work

    # -- pricing -------------------------------------------------------------------------
    def price(self, n: int, context: int, logprob_rows: int = 0) -> float:
        """Priced units of n prompt tokens after `context` computed ones, `logprob_rows` of
        them computing a prompt logprob."""
        return n * (1.0 + (context + (n - 1) / 2) / self.span) + logprob_rows * self.prompt_logprob_cost

    def tokens_within(self, units: float, context: int) -> int:
        """The most tokens after `context` whose price (without logprob rows) is within `units`."""
        if units == math.inf:
            return 1 << 30
        if self.span == math.inf:
            return max(0, int(units))
        a = 1.0 + (context - 0.5) / self.span  # n * a + n^2 / (2 span) <= units
        n = int(self.span * (math.sqrt(a * a + 2.0 * units / self.span) - a))
        while n > 0 and self.price(n, context) > units:
            n -= 1
        return n

    # -- observing -----------------------------------------------------------------------
    @property
    def decode_ms(self) -> float | None:
        """A decode-only step's wall time: the median of the last ones (None: none yet)."""
        return statistics.median(self._decodes) if self._decodes else None

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step's wall time, end to end: the only place the model learns."""
        ms = seconds * 1000.0
        if work.prefill_units <= 0:
            if work.num_decodes:
                self.rows.observe(work.rows, ms)
                self._decodes.append(ms)
                self._quiet += 1
                if self._quiet >= DECODE_SAMPLES:  # the next prompt's cost is its own
                    self.ms_per_unit = None
            return
        self._quiet = 0
        if work.prefill_units < MIN_UNITS:  # a few tokens: the step's noise, not their cost
            return
        if not work.num_decodes:  # a prompt alone: what its next chunk alone costs
            self.ms_per_unit_alone = _average(self.ms_per_unit_alone, ms / work.prefill_units)
            return
        if (base := self.decode_ms) is None:
            return  # nothing to take the decodes' share out with yet
        # at least a tenth of the step is the prompts' (a decode estimate above this
        # step's whole time is noise; a zero cost would lift every bound)
        self.ms_per_unit = _average(self.ms_per_unit, max(ms - base, 0.1 * ms) / work.prefill_units)

    # -- reading -------------------------------------------------------------------------
    def prompt_units(self, decoding: bool) -> float:
        """Priced prompt units for a step that also decodes (`decoding`) or one with prompts
        alone; inf where no time bound applies yet."""
        if not decoding:
            if self.alone_ms <= 0:
                return math.inf
            per = self.ms_per_unit_alone
            return float(PROBE_UNITS) if per is None else max(float(ALONE_MIN_UNITS), self.alone_ms / per)
        if self.target_ms <= 0:
            return math.inf
        if not self.ms_per_unit:
            return math.inf if self.decode_ms is None else float(MIN_UNITS)
        ms = max(self.target_ms, self.decode_ms or 0.0)
        return max(float(MIN_UNITS), ms / self.ms_per_unit)

    def decode_rows(self) -> Callable[[int], float | None]:
        """A decode-only step's expected ms by its rows (speculation's policy reads it)."""
        return self.rows.snapshot()


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - ALPHA) * old + ALPHA * new


class DecodeRows:
    """Milliseconds of a decode-only step by its rows, as measured: the median of each row
    count's last `SAMPLES` steps. A count with fewer than `TRUSTED` samples is read as the
    median of its samples and what the trusted counts say of it: one slow step (a
    collection, a neighbour's burst) does not make a count look dear by itself, and the
    trusted counts alone decide the others; a count not seen for `STALE` decode-only steps
    is forgotten."""

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
        samples = self._samples
        trusted = {r: statistics.median(q) for r, q in samples.items() if len(q) >= TRUSTED}
        table = trusted or {r: statistics.median(q) for r, q in samples.items()}
        counts = sorted(table)

        def read(rows: int) -> float | None:
            model = _read(table, counts, rows)
            own = samples.get(rows)
            if own and trusted and rows not in trusted and model is not None:
                return statistics.median([*own, model])  # one sample is half the word
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
