"""Scheduler properties over random workloads, without a model: the step budget
holds, every request finishes, no block leaks, preemption sends the newest back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.scheduler import Scheduler
from wsllm.engine.sequence import SeqStatus, Sequence
from wsllm.types import SamplingParams

workload = st.lists(
    st.tuples(st.integers(1, 70), st.integers(1, 30), st.integers(0, 6)), min_size=1, max_size=12
)


@settings(max_examples=80, deadline=None)
@given(
    reqs=workload,
    max_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
    blocks=st.integers(13, 40),
    caching=st.booleans(),
)
def test_budget_progress_and_no_leak(reqs, max_seqs, budget, blocks, caching) -> None:  # type: ignore[no-untyped-def]
    bm = BlockManager(blocks, 8, watermark=0.0, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_seqs, budget)
    pending = [
        (arrive, Sequence(f"r{i}", 0, [i % 3 + 1] * plen, SamplingParams(max_tokens=gen), 0.0))
        for i, (plen, gen, arrive) in enumerate(reqs)
        if plen + gen <= blocks * 8
    ]
    for step in range(2000):
        for arrive, s in pending:
            if arrive == step:
                sched.add(s)
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(out.scheduled) <= max_seqs
        assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
        for s, n in out.scheduled:
            assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
            assert len(bm.block_tables[s.seq_id]) * 8 >= s.num_computed_tokens + n
        for s, n in out.scheduled:  # the "model": sample when caught up
            if s.num_computed_tokens + n == s.num_tokens:
                s.output_token_ids.append(7)
                if len(s.output_token_ids) >= s.params.max_tokens:
                    s.status = SeqStatus.FINISHED
        sched.finish_step(out.scheduled)
        bm.check_invariants()
        if step > 6 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "a request never finished"
    assert all(s.finished for _, s in pending)
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_takes_the_newest_and_puts_it_first_in_waiting() -> None:
    bm = BlockManager(4, 8, watermark=0.0)
    sched = Scheduler(bm, 8, 64)
    a = Sequence("a", 0, [1] * 15, SamplingParams(max_tokens=20), 0.0)
    b = Sequence("b", 0, [2] * 15, SamplingParams(max_tokens=20), 0.0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a", "b"]
    for s, _ in out.scheduled:
        s.output_token_ids.append(5)
    sched.finish_step(out.scheduled)
    # both now need a third block; only... 4 blocks total, each holds 2: a grows, b goes
    for s in (a, b):
        s.output_token_ids.append(5)
        s.num_computed_tokens += 1
    out = sched.schedule()
    assert out.preempted == [b]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
