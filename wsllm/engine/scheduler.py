"""Scheduler: decides which sequences run this step and with how many tokens, and, once the
step ran, what each of them computed.

The contract (vLLM v1): `schedule()` returns `{seq: num_new_tokens}` for this step, and
`update_from_output(scheduled, output)` is the one place that decides how many tokens each
sequence computed: it keeps each sequence's samples (a verification of k drafts keeps those up
to and including the first that differs from its draft: a rejected draft is a count, its blocks
trimmed; a plain row is a row with no drafts), appends them (the sequence checks its own stops),
forks the n > 1 choices that sampled from their first choice's row, advances beam searches,
feeds the prefix cache and drops what finished. Plain prefill, chunked prefill, prefix-cache
hits and decode are one mechanism: `num_computed_tokens` catching up with the sequence's
tokens. Queues are served in order: running (oldest first), then swapped, then waiting. When
blocks run out, the newest running sequence of the lowest priority is preempted. Waiting
sequences are admitted by priority, then fairly between tenants (fairness.py).

The budget (`max_num_batched_tokens`) bounds a step's tokens: a prompt token whose row also
computes a prompt logprob (lm_head, log_softmax and top-k over the whole vocabulary) counts
`1 + prompt_logprob_cost`, so such a prompt is prefilled in smaller chunks. Tenants are charged
the same. A step that decodes running streams gives prompts at most
`prefill_tokens_while_decoding` of its budget: a long prompt then arrives in small chunks, so the
streams' next token waits for a short step (Sarathi-Serve's stall-free batching; llama.cpp mixes
prompts in its 512-token micro-batches), and a prompt that arrives while nothing decodes takes
the whole budget, for its first token's sake. A step's prompt work is also kept to about a time,
as the step-cost model estimates it from the steps before (step_cost.py: it prices a chunk by
its tokens and the context its attention reads): `prefill_ms_while_decoding` beside decodes,
`prefill_ms_alone` for prompts alone (so that a lone 8,000-token prompt's steps stay short).

The budget itself is budget.py. The KV manager is one block manager, or one per KV group
(kv_groups.py: a model with sliding-window layers) behind the same calls, each all or nothing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from wsllm.config import EngineConfig
from wsllm.engine.beam import advance
from wsllm.engine.budget import StepBudget
from wsllm.engine.fairness import Fairness
from wsllm.engine.kv_groups import KVManager
from wsllm.engine.model_output import ModelOutput, Sampled
from wsllm.engine.sequence import SeqStatus, Sequence
from wsllm.engine.step_cost import StepCost, StepWork
from wsllm.engine.swap import CpuSwapSpace, swap_space
from wsllm.types import ERR_INTERNAL

log = logging.getLogger(__name__)


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
    # Budget units of prompt work (prompt-logprob rows at their cost) and decodes scheduled.
    prefill_cost: float = 0.0
    num_decodes: int = 0
    # The same prompt work as the step-cost model prices it (its context's attention included).
    prefill_units: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def work(self) -> StepWork:
        """What the step-cost model reads this step's time against."""
        return StepWork(self.prefill_units, self.num_decodes, self.num_tokens)


@dataclass(slots=True)
class StepUpdate:
    """What `update_from_output` decided beyond each sequence's own state."""

    # Sequences whose request must fail, with a code and why (the engine ends them).
    failed: list[tuple[Sequence, str, str]] = field(default_factory=list)
    # Speculative decoding: (sequence, drafts verified, of them matched by its samples, of those
    # kept: a stop or a refusal may end it before its last match).
    verified: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    # Beam searches that ended in this step: the request ids.
    searched: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        block_manager: KVManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        swapper: CpuSwapSpace | None = None,
        prompt_logprob_cost: float = 0.0,
        prefill_tokens_while_decoding: int | None = None,
        cost: StepCost | None = None,  # the step-cost model (default: no time bound)
        eos_token_ids: list[int] | None = None,
        max_model_len: int = 1 << 30,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swapper = swapper  # when preemption_mode == "swap"
        self.prompt_logprob_cost = prompt_logprob_cost  # budget tokens per prompt-logprob row, extra
        # the budget left to prompts in a step that also decodes (None: the whole budget)
        self.prefill_while_decoding = prefill_tokens_while_decoding or max_num_batched_tokens
        self.cost = cost or StepCost(prompt_logprob_cost=prompt_logprob_cost)
        self.eos_token_ids = eos_token_ids or []
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swaps = 0
        self.fairness = Fairness()

    @classmethod
    def from_config(
        cls, bm: KVManager, config: EngineConfig, num_cpu_blocks: list[int], cost: StepCost,
        eos_token_ids: list[int], max_model_len: int,
    ) -> Scheduler:  # fmt: skip
        """An engine's scheduler, as its config says, with CPU swap space when it has blocks
        (`num_cpu_blocks`: per KV group)."""
        swapper = swap_space(bm, num_cpu_blocks)
        c = config
        return cls(bm, c.max_num_seqs, c.max_num_batched_tokens, c.preemption_mode, swapper,
                   c.prompt_logprob_cost, c.prefill_tokens_while_decoding, cost, eos_token_ids, max_model_len)  # fmt: skip

    @property
    def served(self) -> dict[str, float]:
        """tenant -> its virtual token counter (fairness.py)."""
        return self.fairness.served

    # -- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.fairness.joined(seq, self._active_tenants())
        self.waiting.append(seq)

    def _active_tenants(self) -> set[str]:
        return {q.tenant for queue in (self.running, self.waiting, self.swapped) for q in queue}

    def admission_rank(self) -> Callable[[int, str], tuple[int, float]]:
        """How a request not yet added would be ranked now (lower goes first)."""
        return self.fairness.rank(self._active_tenants())

    def has_backlog(self) -> bool:
        """Whether sequences wait for room in the batch."""
        return bool(self.waiting or self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whatever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            if self.swapper is not None:
                self.swapper.free(seq.seq_id)
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
        child.images, child.image_spans = parent.images, parent.image_spans  # and its images
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def _take(self, out: SchedulerOutput, budget: StepBudget, seq: Sequence, n: int, cost: int) -> None:
        """Schedule n tokens of `seq` at `cost` of the budget: charged to its tenant and
        counted as prompt work or a decode for the step-cost model."""
        out.scheduled.append((seq, n))
        self.fairness.charge(seq, cost)
        units = budget.take(seq, n, cost)
        if budget.prompt_work(seq):
            out.prefill_cost += cost
            out.prefill_units += units
        else:
            out.num_decodes += 1

    # -- the step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = StepBudget(
            self.max_num_batched_tokens, self.prefill_while_decoding, self.max_num_batched_tokens,
            self.prompt_logprob_cost, self.cost,
        )  # fmt: skip
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        now = time.time()
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        # Decodes first, then unfinished prompt chunks, so a long prompt being
        # prefilled in chunks never takes a running stream's token for a step.
        queue = [q for q in self.running if q.num_uncomputed <= 1]
        queue += [q for q in self.running if q.num_uncomputed > 1]
        taken: set[int] = set()
        decodes = 0
        for seq in queue:
            if decodes and seq.num_uncomputed > 1:
                budget.decoding()  # streams decode in this step: what follows is prompt work
            if budget.tokens <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n, cost = budget.fit(seq)
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
                decodes += seq.num_uncomputed <= 1
                self._take(out, budget, seq, n, cost)
                taken.add(seq.seq_id)
        if decodes:
            budget.decoding()

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
        return self.bm.reserve(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)

    def _schedule_swapped(self, out: SchedulerOutput, budget: StepBudget) -> None:
        sw = self.swapper
        while self.swapped and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if sw is None or not sw.can_swap_in(seq, self.bm):
                break
            self.swapped.popleft()
            out.swap_in.extend(sw.swap_in(seq, self.bm))
            self.num_swaps += 1
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n, cost = budget.fit(seq)
            if n == 0 or not self.bm.ensure_slots(seq.seq_id, seq.num_computed_tokens + n):
                break  # keep it running; it gets its token next step
            self._take(out, budget, seq, n, cost)

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while self.waiting and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0] if len(self.waiting) == 1 else self.fairness.next(self.waiting)
            tokens = seq.token_ids
            first = budget.fit(seq)[0]  # no cache hit: the most it computes now
            use_cache = not seq.params.needs_every_position  # prompt logprobs, mean pooling
            if first == 0 or not self.bm.can_allocate(
                tokens, first, use_cache, seq.cache_root, seq.image_spans
            ):
                break
            cached = self.bm.allocate(seq.seq_id, tokens, first, use_cache, seq.cache_root, seq.image_spans)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            n, cost = budget.fit(seq)
            if not self.bm.ensure_slots(seq.seq_id, cached + n):  # cannot happen: checked above
                self.bm.free(seq.seq_id)
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._take(out, budget, seq, n, cost)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        self.num_preemptions += 1
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if any(s is seq for s, _ in out.scheduled):
            raise AssertionError("preempting a sequence already scheduled this step")
        sw = self.swapper
        if self.preemption_mode == "swap" and sw is not None and sw.can_swap_out(seq, self.bm):
            out.swap_out.extend(sw.swap_out(seq, self.bm))
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

    # -- after the forward pass -----------------------------------------------
    def update_from_output(self, out: SchedulerOutput, output: ModelOutput) -> StepUpdate:
        """What the step computed: forks the choices that sampled from their first choice's
        row (before it appends), keeps and appends each sequence's samples, advances beam
        searches, then advances every scheduled sequence by what it computed, feeds the
        prefix cache with its full blocks, trims a verification's rejected blocks and drops
        the sequences that finished."""
        update = StepUpdate()
        computed = {seq.seq_id: n for seq, n in out.scheduled}
        for s in output.sampled:
            if s.parent is not None:
                self.fork(s.parent, s.seq)
                s.parent.forks = []
        for s in output.sampled:
            seq = s.seq
            if s.candidates is not None and seq.beam is not None:
                if advance(seq.beam, seq, s.candidates, self.fork, self.remove) and seq.beam.state.done:
                    update.searched.append(seq.request_id)
                continue
            kept = self._keep(s, update)
            if seq.draft_token_ids:  # a rejected draft is a count: not computed
                computed[seq.seq_id] = kept
        for seq, _ in out.scheduled:
            drafted, seq.draft_token_ids = bool(seq.draft_token_ids), []
            if seq.finished:
                continue
            seq.num_computed_tokens += computed[seq.seq_id]
            # keys for its full blocks; a windowed group gives back what its window left behind
            self.bm.register_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if drafted:
                self.bm.trim(seq.seq_id, seq.num_tokens)  # the blocks of rejected drafts only
        for seq in [s for s in self.running if s.finished]:
            self.running.remove(seq)
            self.bm.free(seq.seq_id)
        return update

    def _keep(self, s: Sampled, update: StepUpdate) -> int:
        """A sequence's samples kept and appended (Sequence.keep_samples); how many it kept."""
        seq, k = s.seq, len(s.seq.draft_token_ids)
        kept, matched, failure = seq.keep_samples(
            s.token_ids, s.logprobs, self.eos_token_ids, self.max_model_len
        )
        if failure is not None:  # a row that could not be sampled, or a token its grammar refused
            code, why = failure
            update.failed.append((seq, code, s.error or why if code == ERR_INTERNAL else why))
        if k:
            seq.num_drafted += k
            seq.num_accepted += min(matched, kept)
            update.verified.append((seq, k, matched, min(matched, kept)))
        return kept
