"""One step's budget: what the scheduler may still give the sequences it schedules.

Tokens (`max_num_batched_tokens`): a prompt token whose row also computes a prompt logprob
(lm_head, log_softmax and top-k over the whole vocabulary) counts `1 + prompt_logprob_cost`, so
such a prompt is prefilled in smaller chunks and no request makes a step longer than the budget
allows; tenants are charged the same. In a step that also decodes, prompts get at most
`prefill_tokens_while_decoding` of it (`decoding`). Prompt time: the priced units of prompt work
the step-cost model says fit (step_cost.py: a chunk's tokens and the context its attention
reads), beside decodes or alone, never below a floor of budget tokens a step (a prompt always
progresses: `MIN_UNITS` beside decodes, `ALONE_MIN_UNITS` alone).

What a prompt-logprob row costs, beside its token (`prompt_logprob_cost`): one LM-head row
(vocab x hidden multiply-adds) and a few passes over its logits (gather, top-k, logsumexp;
ModelRunner._token_logprobs); a token's forward is every other weight (params - vocab x hidden
multiply-adds) plus its attention. At equal kernel efficiency the ratio is vocab x hidden /
(params - vocab x hidden): SmolLM2-135M 28.3M / 106M = 0.27, a Llama-3-8B 0.5G / 7.5G = 0.07.
Measured on the bundled SmolLM2 (Q8_0 head, Q4_1 layers, one CPU thread, a 1,000-token prompt in
128-token chunks beside 16 decodes): a row 0.8-1.05 ms (top 20: 0.85-1.2; the head alone
0.65-0.9), a prompt token 2.5-4.5 ms as the context grows, so 0.25-0.4. The default of 1.0
(EngineConfig) charges about 3x that: such a prompt's chunks are half a plain chunk, and its
steps are shorter than a plain prompt's at the same budget (128 rows beside 16 decodes: 0.5-0.8 s
of CPU; 256 plain tokens: 0.9-1.15 s).
"""

from __future__ import annotations

import math

from wsllm.engine.sequence import Sequence
from wsllm.engine.step_cost import ALONE_MIN_UNITS, MIN_UNITS, StepCost


class StepBudget:
    def __init__(
        self, tokens: int, cap_while_decoding: int, whole: int, prompt_logprob_cost: float, cost: StepCost
    ) -> None:
        self.tokens = tokens  # budget tokens left
        self.cap_while_decoding = cap_while_decoding
        self.whole = whole  # a whole budget: at least one token fits it
        self.extra = prompt_logprob_cost
        self.cost = cost
        self.time = cost.prompt_units(decoding=False)  # priced prompt units left; until decodes run
        self.floor = float(ALONE_MIN_UNITS)  # budget tokens of prompt work left to the floor
        self.decodes = False

    def decoding(self) -> None:
        """Streams decode in this step: what follows is prompt work beside them."""
        if not self.decodes:
            self.decodes = True
            self.tokens = min(self.tokens, self.cap_while_decoding)
            self.time = self.cost.prompt_units(decoding=True)
            self.floor = float(MIN_UNITS)

    @staticmethod
    def prompt_work(seq: Sequence) -> bool:
        """Whether `seq`'s tokens this step are prompt work (a chunk, or a prompt's one token)
        rather than a decode (its last token, with or without drafts)."""
        return seq.num_uncomputed > 1 or seq.num_computed_tokens < len(seq.prompt_token_ids)

    def logprob_rows(self, seq: Sequence, n: int) -> int:
        """Of n tokens of `seq` from its computed ones, the rows that compute a prompt logprob."""
        if seq.params.prompt_logprobs is None:
            return 0
        return min(n, max(0, len(seq.prompt_token_ids) - 1 - seq.num_computed_tokens))

    def fit(self, seq: Sequence) -> tuple[int, int]:
        """(tokens, cost): how many of `seq`'s uncomputed tokens fit in the budget, and what they
        take from it. At least one token when the budget is whole, so a request always
        progresses; else nothing rather than past the budget. A prompt chunk is also cut to the
        step's prompt time left (never below the step's floor)."""
        n, cost = self._fit_tokens(seq, self.tokens)
        if not self.prompt_work(seq) or n == 0:
            return n, cost
        low = self._fit_tokens(seq, int(min(self.tokens, max(0.0, self.floor))))[0]
        if self.time == math.inf or n <= low:
            return n, cost
        hi = n  # the most whose price fits
        while low < hi:
            mid = (low + hi + 1) // 2
            if self._units(seq, mid) <= self.time:
                low = mid
            else:
                hi = mid - 1
        return low, self._cost(seq, low)

    def _cost(self, seq: Sequence, n: int) -> int:
        """Budget tokens of n prompt tokens of `seq`: a prompt-logprob row's extra, rounded up."""
        return math.ceil(n + self.logprob_rows(seq, n) * self.extra)

    def _units(self, seq: Sequence, n: int) -> float:
        """Prompt time of n tokens of `seq`: their price, never below the budget tokens they are
        charged (a logprob row's extra rounds up there), so a step's prompt work in budget tokens
        stays within its time."""
        rows = self.logprob_rows(seq, n)
        return max(self.cost.price(n, seq.num_computed_tokens, rows), float(self._cost(seq, n)))

    def _fit_tokens(self, seq: Sequence, budget: int) -> tuple[int, int]:
        left = seq.num_uncomputed
        if left == 1:  # a decode; with drafts to verify, a row of 1 + k tokens
            left += len(seq.draft_token_ids)
        rows = self.logprob_rows(seq, left) if self.extra else 0  # rows that predict a prompt token
        if not rows:
            n = min(left, budget)
            return n, n
        per = 1 + self.extra
        if rows * per >= budget:
            n = min(left, int(budget // per) or (1 if budget >= self.whole else 0))
        else:  # every row fits; plain tokens (the prompt's last, its output) after them
            n = min(left, rows + int(budget - rows * per))
        return n, math.ceil(n + min(n, rows) * self.extra)

    def take(self, seq: Sequence, n: int, cost: int) -> float:
        """`seq` takes n tokens at `cost`; returns their priced units when they are prompt work."""
        self.tokens -= cost
        if not self.prompt_work(seq):
            return 0.0
        units = max(self._units(seq, n), float(cost))
        self.time -= units
        self.floor -= cost
        return units
