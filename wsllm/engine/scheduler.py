"""Scheduler: decides which sequences run this step and with how many tokens.

The contract (vLLM v1): `schedule()` returns `{seq: num_new_tokens}` for this step.
Plain prefill, chunked prefill, prefix-cache hits and decode are one mechanism:
`num_computed_tokens` catching up with the sequence's tokens. Queues are served in
order: running (oldest first), then swapped, then waiting (FCFS). When blocks run
out, the newest running sequence is preempted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.sequence import SeqStatus, Sequence

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

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        swapper: object | None = None,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swapper = swapper  # CpuSwapSpace when preemption_mode == "swap"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swaps = 0

    # -- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        child.num_computed_tokens = parent.num_tokens  # the parent caught up this step
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
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
        for seq in queue:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            if n == 0:
                continue  # a beam waiting for the rest of its group
            while not self._reserve(seq, n):
                victim = next((q for q in reversed(self.running) if q.seq_id not in taken), seq)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.copies.extend(self.bm.copy_on_write(seq.seq_id, seq.num_computed_tokens))
                out.scheduled.append((seq, n))
                taken.add(seq.seq_id)
                budget -= n
        return budget

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
            n = min(seq.num_uncomputed, budget)
            if not self.bm.ensure_slots(seq.seq_id, seq.num_computed_tokens + n):
                break  # keep it running; it gets its token next step
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.token_ids
            first = min(seq.num_tokens, budget)
            if not self.bm.can_allocate(tokens, first):
                break
            cached = self.bm.allocate(seq.seq_id, tokens, first)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            n = min(seq.num_uncomputed, budget)
            if not self.bm.ensure_slots(seq.seq_id, cached + n):  # cannot happen: checked above
                self.bm.free(seq.seq_id)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
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
