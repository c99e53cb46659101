"""Scheduler: decides which sequences run this step and with how many tokens.

The contract (vLLM v1): `schedule()` returns `{seq: num_new_tokens}` for this step.
Plain prefill, chunked prefill, prefix-cache hits and decode are one mechanism:
`num_computed_tokens` catching up with the sequence's tokens. Queues are served in
order: running (oldest first), then swapped, then waiting. When blocks run out, the
newest running sequence of the lowest priority is preempted.

Waiting sequences are admitted by priority (higher first; a preempted sequence before
new ones of its priority), then fairly between tenants: each tenant has a virtual
token counter (VTC, "Fairness in Serving Large Language Models", OSDI '24) that grows
by every token the engine computes for it, and the tenant with the lowest counter
goes next; ties go to the oldest. A tenant that comes back after being idle starts
just below the lowest counter of the tenants present: it goes next, but idling banks
no credit. With one tenant and one priority this is plain FCFS.

The budget (`max_num_batched_tokens`) bounds a step's work, not only its tokens: a prompt
token whose row also computes a prompt logprob (lm_head, log_softmax and top-k over the
whole vocabulary) costs `1 + prompt_logprob_cost`, so such a prompt is prefilled in
smaller chunks and no request makes a step longer than the budget allows. Tenants are
charged the same cost. A step that decodes running streams gives prompts at most
`prefill_tokens_while_decoding` of its budget: a long prompt then arrives in small
chunks, so the streams' next token waits for a short step (Sarathi-Serve's stall-free
batching; llama.cpp mixes prompts in its 512-token micro-batches), and a prompt that
arrives while nothing decodes still takes the whole budget, for its first token's sake.
A token's cost grows with its context and the machine's load, so such a step's prompt
work is also kept to about `prefill_ms_while_decoding` of time, as estimated from the
steps before (`pacing.StepPacer`; the engine reports each step's time to `observe_step`).

What a prompt-logprob row costs, beside its token (`prompt_logprob_cost`): one LM-head row
(vocab x hidden multiply-adds) and a few passes over its logits (gather, top-k, logsumexp;
ModelRunner._token_logprobs); a token's forward is every other weight (params - vocab x
hidden multiply-adds) plus its attention. At equal kernel efficiency the ratio is
vocab x hidden / (params - vocab x hidden): SmolLM2-135M 28.3M / 106M = 0.27, a Llama-3-8B
0.5G / 7.5G = 0.07. Measured on the bundled SmolLM2 (Q8_0 head, Q4_1 layers, one CPU thread,
a 1,000-token prompt in 128-token chunks beside 16 decodes): a row 0.8-1.05 ms (top 20:
0.85-1.2; the head alone 0.65-0.9), a prompt token 2.5-4.5 ms as the context grows, so
0.25-0.4. The default of 1.0 (EngineConfig) charges about 3x that: such a prompt's
chunks are half a plain chunk, and its steps are shorter than a plain prompt's at the
same budget (128 rows beside 16 decodes: 0.5-0.8 s of CPU; 256 plain tokens: 0.9-1.15 s).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from wsllm.config import EngineConfig
from wsllm.engine.block_manager import BlockManager
from wsllm.engine.pacing import StepPacer
from wsllm.engine.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)

# Counters kept for tenants with nothing queued, at most (past it the idle ones go).
_MAX_TENANTS = 4096


@dataclass(slots=True)
class SchedulerOutput:
    # Sequences to run and the number of new tokens each computes, in batch order.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    # KV block copies (src, dst) to do before the forward pass (copy-on-write).
    copies: list[tuple[int, int]] = field(default_factory=list)
    # Swap work for the cache engine: (gpu_block, cpu_block) pairs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Sequences preempted in this step (already moved back to waiting / swapped).
    preempted: list[Sequence] = field(default_factory=list)
    # Budget units of prompt work (prompt-logprob rows at their cost) and decodes scheduled:
    # what the step pacer reads the step's time against.
    prefill_cost: float = 0.0
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        swapper: object | None = None,
        prompt_logprob_cost: float = 0.0,
        prefill_tokens_while_decoding: int | None = None,
        prefill_ms_while_decoding: float = 0.0,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swapper = swapper  # CpuSwapSpace when preemption_mode == "swap"
        self.prompt_logprob_cost = prompt_logprob_cost  # budget tokens per prompt-logprob row, extra
        # the budget left to prompts in a step that also decodes (None: the whole budget)
        self.prefill_while_decoding = prefill_tokens_while_decoding or max_num_batched_tokens
        self.pacer = StepPacer(prefill_ms_while_decoding)  # the same, in time
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swaps = 0
        #: tenant -> tokens computed for it (its virtual counter)
        self.served: dict[str, float] = {}

    @classmethod
    def from_config(cls, bm: BlockManager, config: EngineConfig, num_cpu_blocks: int) -> Scheduler:
        """An engine's scheduler, as its config says, with CPU swap space when it has blocks."""
        swapper = None
        if num_cpu_blocks:
            from wsllm.engine.swap import CpuSwapSpace

            swapper = CpuSwapSpace(num_cpu_blocks)
        c = config
        return cls(bm, c.max_num_seqs, c.max_num_batched_tokens, c.preemption_mode, swapper,
                   c.prompt_logprob_cost, c.prefill_tokens_while_decoding, c.prefill_ms_while_decoding)  # fmt: skip

    # -- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        active = self._active_tenants()
        if seq.tenant not in active:  # (back) from idle: no credit for the time away
            self.served[seq.tenant] = self._lifted(seq.tenant, active)
            if len(self.served) > _MAX_TENANTS:  # forget the idle ones
                self.served = {t: c for t, c in self.served.items() if t in active or t == seq.tenant}
        self.waiting.append(seq)

    def _active_tenants(self) -> set[str]:
        return {q.tenant for queue in (self.running, self.waiting, self.swapped) for q in queue}

    def _lifted(self, tenant: str, active: set[str]) -> float:
        """The counter of `tenant` if it became active now."""
        own = self.served.get(tenant, 0.0)
        if tenant in active or not active:
            return own
        return max(own, min(self.served.get(t, 0.0) for t in active) - 0.5)

    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]:
        """How a request not yet added would be ranked now (lower goes first): by
        priority, then by its tenant's counter, lifted as `add` would lift it."""
        active = self._active_tenants()
        lifted: dict[str, float] = {}

        def rank(priority: int, tenant: str) -> tuple[int, float]:
            if tenant not in lifted:
                lifted[tenant] = self._lifted(tenant, active)
            return -priority, lifted[tenant]

        return rank

    def _charge(self, seq: Sequence, n: int) -> None:
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + n

    def _take(self, out: SchedulerOutput, seq: Sequence, n: int, cost: int) -> None:
        """Schedule n tokens of `seq` at `cost` of the budget: charged to its tenant and
        counted as prompt work or a decode for the pacer."""
        out.scheduled.append((seq, n))
        self._charge(seq, cost)
        if seq.num_uncomputed > 1:
            out.prefill_cost += cost
        else:
            out.num_decodes += 1

    def _while_decoding(self, budget: int) -> int:
        """What is left of `budget` for prompts in a step that decodes: the token cap
        and the pacer's estimate of what fits in `prefill_ms_while_decoding`."""
        return int(min(budget, self.prefill_while_decoding, self.pacer.units()))

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine's report of how long the step of `out` took, end to end."""
        self.pacer.observe(out.prefill_cost, out.num_decodes, seconds)

    def _fit(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(tokens, cost): how many of `seq`'s uncomputed tokens fit in `budget`, and
        what they take from it. A token whose row computes a prompt logprob costs
        `1 + prompt_logprob_cost`. At least one token when the budget is whole, so a
        request always progresses; else nothing rather than past the budget."""
        left, extra = seq.num_uncomputed, self.prompt_logprob_cost
        if left == 1:  # a decode; with drafts to verify, a row of 1 + k tokens
            left += len(seq.draft_token_ids)
        rows = 0  # uncomputed positions whose row predicts a prompt token
        if seq.params.prompt_logprobs is not None and extra:
            rows = max(0, len(seq.prompt_token_ids) - 1 - seq.num_computed_tokens)
        if not rows:
            n = min(left, budget)
            return n, n
        per = 1 + extra
        if rows * per >= budget:
            n = min(left, int(budget // per) or (1 if budget >= self.max_num_batched_tokens else 0))
        else:  # every row fits; plain tokens (the prompt's last, its output) after them
            n = min(left, rows + int(budget - rows * per))
        return n, math.ceil(n + min(n, rows) * extra)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whatever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            if self.swapper is not None:
                self.swapper.free(seq.seq_id)  # type: ignore[attr-defined]
        self.bm.free(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of `parent` as it stands after this step's forward
        pass: it shares every block (copied on write) and runs from the next step.
        n > 1 choices fork from choice 0 once its prompt is computed; beams fork when a
        beam continues in several ways."""
        self.bm.fork(parent.seq_id, child.seq_id)
        child.output_token_ids = list(parent.output_token_ids)
        child.matcher = parent.matcher.deep_copy() if parent.matcher is not None else None
        child.num_computed_tokens = parent.num_tokens  # the parent caught up this step
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.priority, child.tenant = parent.priority, parent.tenant
        child.cache_root, child.lora = parent.cache_root, parent.lora  # a recompute keeps both
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- the step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        now = time.time()
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first, then unfinished prompt chunks, so a long prompt being
        # prefilled in chunks never takes a running stream's token for a step.
        queue = [q for q in self.running if q.num_uncomputed <= 1]
        queue += [q for q in self.running if q.num_uncomputed > 1]
        taken: set[int] = set()
        decodes, capped = 0, False
        for seq in queue:
            if not capped and decodes and seq.num_uncomputed > 1:
                capped = True  # streams decode in this step: what follows is prompt work
                budget = self._while_decoding(budget)
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n, cost = self._fit(seq, budget)
            if n == 0:
                continue  # a beam waiting for the rest of its group, or a chunk that does not fit
            if seq.draft_token_ids:
                n = cost = self._with_drafts(seq, n)
            while not self._reserve(seq, n):
                victim = self._victim(seq, taken)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.copies.extend(self.bm.copy_on_write(seq.seq_id, seq.num_computed_tokens))
                self._take(out, seq, n, cost)
                taken.add(seq.seq_id)
                decodes += seq.num_uncomputed <= 1
                budget -= cost
        if decodes and not capped:
            budget = self._while_decoding(budget)
        return budget

    def _with_drafts(self, seq: Sequence, n: int) -> int:
        """A decode that verifies drafts (speculative decoding): one row of its last token
        and the drafts that fit the budget (`n`) and the free blocks, never at the cost of
        preempting anyone; the drafts that do not fit are dropped."""
        if n > 1 and not self._reserve(seq, n):
            n = 1
        del seq.draft_token_ids[n - 1 :]
        return n

    def _victim(self, seq: Sequence, taken: set[int]) -> Sequence:
        """Whom to preempt so that `seq` gets blocks: the newest of the lowest priority
        among those not scheduled yet this step (`seq` is one of them: itself, when
        everyone else ranks above it)."""
        free = [(q.priority, -i, q) for i, q in enumerate(self.running) if q.seq_id not in taken]
        return min(free, key=lambda t: (t[0], t[1]))[2] if free else seq

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for n more tokens, plus private copies of shared blocks it writes."""
        cow = self.bm.cow_blocks_needed(seq.seq_id, seq.num_computed_tokens)
        grow = self.bm.blocks_for(seq.num_computed_tokens + n) - len(self.bm.block_tables[seq.seq_id])
        if cow and self.bm.num_free_blocks < cow + max(0, grow):
            return False
        return self.bm.ensure_slots(seq.seq_id, seq.num_computed_tokens + n)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if self.swapper is None or not self.swapper.can_swap_in(seq, self.bm):  # type: ignore[attr-defined]
                break
            self.swapped.popleft()
            out.swap_in.extend(self.swapper.swap_in(seq, self.bm))  # type: ignore[attr-defined]
            self.num_swaps += 1
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n, cost = self._fit(seq, budget)
            if n == 0 or not self.bm.ensure_slots(seq.seq_id, seq.num_computed_tokens + n):
                break  # keep it running; it gets its token next step
            self._take(out, seq, n, cost)
            budget -= cost
        return budget

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next (see the module's docstring)."""
        if len(self.waiting) == 1:
            return self.waiting[0]
        served = self.served
        return min(
            enumerate(self.waiting),
            key=lambda iq: (
                -iq[1].priority,
                iq[1].num_preemptions == 0,
                served.get(iq[1].tenant, 0.0),
                iq[0],
            ),
        )[1]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
            tokens = seq.token_ids
            first = self._fit(seq, budget)[0]  # no cache hit: the most it computes now
            use_cache = not seq.params.needs_every_position  # prompt logprobs, mean pooling
            if first == 0 or not self.bm.can_allocate(tokens, first, use_cache, seq.cache_root):
                break
            cached = self.bm.allocate(seq.seq_id, tokens, first, use_cache, seq.cache_root)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            n, cost = self._fit(seq, budget)
            if not self.bm.ensure_slots(seq.seq_id, cached + n):  # cannot happen: checked above
                self.bm.free(seq.seq_id)
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._take(out, seq, n, cost)
            budget -= cost

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if any(s is seq for s, _ in out.scheduled):
            raise AssertionError("preempting a sequence already scheduled this step")
        if (
            self.preemption_mode == "swap"
            and self.swapper is not None
            and self.swapper.can_swap_out(seq, self.bm)
        ):  # type: ignore[attr-defined]
            out.swap_out.extend(self.swapper.swap_out(seq, self.bm))  # type: ignore[attr-defined]
            self.num_swaps += 1
            seq.status = SeqStatus.SWAPPED
            self.swapped.appendleft(seq)
            return
        # Recompute: drop its KV; it re-prefills prompt + output so far later.
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        log.debug("preempted %s by recompute", seq.request_id)

    def finish_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After the forward pass: advance counters, register full blocks for the
        prefix cache, drop finished sequences."""
        for seq, n in scheduled:
            if seq.finished:
                continue
            seq.num_computed_tokens += n
            self.bm.register_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.running.remove(seq)
            self.bm.free(seq.seq_id)
