"""How much prompt work a step that also decodes running streams may take, in time.

`prefill_tokens_while_decoding` caps the prompt tokens of such a step, but a token's
cost is not fixed: on a CPU a prompt token at a context of 1,500 costs ~2.6x one at 0
(the attention), a prompt-logprobs row costs more again, and on a shared machine every
step stretches. The streams wait for the whole step, so their inter-token gap is the
decode plus whatever prompt work rode along (issue 23: a tenant's long prompts should
stretch its own time-to-first-token, not everyone's gaps).

So the engine also keeps a step's prompt work to about `prefill_ms_while_decoding`:
from the steps it has run it keeps a decode-only step's wall time (the median of the
last `DECODE_SAMPLES`: one step stalled by something else, a GIL held for a second,
must not pass for the decodes' cost, or every later step's prompt work would look
free) and a moving average of the milliseconds one unit of prompt budget takes (a
prompt token; a prompt-logprob row `1 + prompt_logprob_cost`, as the scheduler counts
them), measured as a step's time beyond its decodes over its prompt units. A long
prompt's chunks follow one another, so the average follows the context as it grows,
and the machine's load as it changes (a stalled step makes the next chunks smaller,
which is the safe side). A step that decodes gives prompts what fits in
`prefill_ms_while_decoding` or in a decode-only step's time, whichever is longer: a long
prompt at most about doubles the streams' gap, and a large batch, whose steps are long
anyway, still takes new prompts in about as fast as before (bench/serving_peers.py and
bench/amplification.py in docs/benchmarks.md). That is `ms / ms_per_unit` units, never
fewer than `MIN_UNITS` (a prompt always progresses, whatever a step costs) and never more
than the token cap. A step with nothing to decode still gives a prompt the whole budget,
for its first token's sake; on a GPU, where a prompt token costs microseconds, the token
cap is the bound. The estimate comes from steps with prompt work beside decodes only (a
prompt alone in its step is a cheaper batch); beside decodes already measured, the first
such step takes the floor (the first prompt-logprobs chunk
beside 16 streams took 61 tokens and 116 ms when nothing bounded it: bench/
amplification.py, 2026-11-28); with no decode-only step seen yet only the token cap
applies. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# Prompt budget units a step that decodes always allows (a prompt always progresses): 8 tokens,
# or 4 prompt-logprobs rows. At a context of 1,500 on 2 AVX2 cores a SmolLM2 prompt token costs
# ~6 ms beside 16 decodes, so the floor, not the target, bounds such steps: 16 units made them
# ~3x a decode-only step, 8 about 2x (bench/amplification.py, docs/benchmarks.md).
MIN_UNITS = 8
# Weight of the newest step in the moving average of a unit's cost: a long prompt's next
# chunk costs about what its last one did, so the newest counts for half.
ALPHA = 0.5
# Decode-only steps whose median is the decodes' share of a step; as many in a row forget a
# prompt unit's cost (the next prompt comes at another context, and with other work on the
# machine: the first chunk after a quiet stretch takes the floor and measures it again).
DECODE_SAMPLES = 15


class StepPacer:
    """Estimates from the steps run; answers how many prompt units fit beside decodes."""

    def __init__(self, target_ms: float) -> None:
        self.target_ms = target_ms  # 0: no time bound
        self._decodes: deque[float] = deque(maxlen=DECODE_SAMPLES)  # decode-only steps' ms
        self.ms_per_unit: float | None = None  # one unit of prompt budget's share of a step
        self._quiet = 0  # decode-only steps since the last with prompt work

    @property
    def decode_ms(self) -> float | None:
        """A decode-only step's wall time: the median of the last ones (None: none yet)."""
        return statistics.median(self._decodes) if self._decodes else None

    def observe(self, prefill_units: float, num_decodes: int, seconds: float) -> None:
        """One step that ran `prefill_units` of prompt work beside `num_decodes` decodes."""
        ms = seconds * 1000.0
        if prefill_units <= 0:
            if num_decodes:
                self._decodes.append(ms)
                self._quiet += 1
                if self._quiet >= DECODE_SAMPLES:  # the next prompt's cost is its own
                    self.ms_per_unit = None
            return
        self._quiet = 0
        if prefill_units < MIN_UNITS:  # a few tokens: the step's noise, not their cost
            return
        # Only steps beside decodes teach a unit's cost there: prompts alone in a step run
        # as a larger batch at a short context (the first prompt chunk beside 16 streams,
        # priced after such steps, took 134 tokens and 82 ms where the next ones took 40-50:
        # bench/amplification.py, 2026-11-28).
        if not num_decodes or (base := self.decode_ms) is None:
            return  # nothing to take the decodes' share out with yet
        # at least a tenth of the step is the prompts' (a decode estimate above this
        # step's whole time is noise; a zero cost would lift every bound)
        self.ms_per_unit = _average(self.ms_per_unit, max(ms - base, 0.1 * ms) / prefill_units)

    def units(self) -> float:
        """Prompt budget units for a step that also decodes (inf: no time bound yet).
        With decodes measured but no prompt unit yet, the floor: a step of unknown cost
        beside the streams is a small one, and it measures the unit for the next."""
        if self.target_ms <= 0:
            return math.inf
        if not self.ms_per_unit:
            return math.inf if self.decode_ms is None else float(MIN_UNITS)
        ms = max(self.target_ms, self.decode_ms or 0.0)
        return max(float(MIN_UNITS), ms / self.ms_per_unit)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - ALPHA) * old + ALPHA * new
