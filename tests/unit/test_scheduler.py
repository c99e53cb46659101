"""Scheduler properties over random workloads, without a model: the step budget
holds (prompt-logprob rows counted at their cost), every request finishes, no block leaks, preemption sends the newest of the
lowest priority back; priority and tenant fairness decide who is admitted; a step that decodes keeps its prompt
work to the time the pacer allows."""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.model_output import ModelOutput, Sampled
from wsllm.engine.scheduler import Scheduler, SchedulerOutput
from wsllm.engine.sequence import SeqStatus, Sequence
from wsllm.engine.step_cost import MIN_UNITS, StepCost, StepWork
from wsllm.types import SamplingParams

workload = st.lists(
    st.tuples(
        st.integers(1, 70),
        st.integers(1, 30),
        st.integers(0, 6),
        st.integers(0, 2),
        st.sampled_from("ab"),
        st.booleans(),  # wants prompt logprobs
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(
    reqs=workload,
    max_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
    blocks=st.integers(13, 40),
    caching=st.booleans(),
    plp_cost=st.sampled_from([0.0, 1.0, 2.5]),
    while_decoding=st.sampled_from([None, 3, 16]),
    paced=st.sampled_from([(0.0, 0.0), (5.0, 1e-4), (5.0, 1e-2)]),  # (target ms, seconds a budget unit takes)
)
def test_budget_progress_and_no_leak(
    reqs, max_seqs, budget, blocks, caching, plp_cost, while_decoding, paced
) -> None:  # type: ignore[no-untyped-def]
    bm = BlockManager(blocks, 8, watermark=0.0, enable_prefix_caching=caching)
    sched = Scheduler(
        bm,
        max_seqs,
        budget,
        prompt_logprob_cost=plp_cost,
        prefill_tokens_while_decoding=while_decoding,
        cost=StepCost(prefill_ms_while_decoding=paced[0], prompt_logprob_cost=plp_cost),
    )
    pending = [
        (
            arrive,
            Sequence(
                f"r{i}",
                0,
                [i % 3 + 1] * plen,
                SamplingParams(max_tokens=gen, prompt_logprobs=1 if plp else None),
                0.0,
                priority=p,
                tenant=t,
            ),
        )
        for i, (plen, gen, arrive, p, t, plp) in enumerate(reqs)
        if plen + gen <= blocks * 8
    ]
    for step in range(2000):
        for arrive, s in pending:
            if arrive == step:
                sched.add(s)
        streaming = {id(s) for s in sched.running if s.num_uncomputed <= 1}
        paced_units = sched.cost.prompt_units(decoding=True)
        out = sched.schedule()
        cost = sum(step_cost(s, n, plp_cost) for s, n in out.scheduled)
        assert cost <= budget
        if any(id(s) in streaming for s, _ in out.scheduled):
            prompts = sum(step_cost(s, n, plp_cost) for s, n in out.scheduled if id(s) not in streaming)
            if while_decoding:
                assert prompts <= while_decoding, "a step that decodes took more prompt work than allowed"
            assert prompts <= paced_units, "a step that decodes took more prompt work than fits its time"
        sched.cost.observe(out.work, 0.001 * len(out.scheduled) + paced[1] * cost)
        assert len(out.scheduled) <= max_seqs
        assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
        for s, n in out.scheduled:
            assert n >= 1 and s.num_computed_tokens + n <= s.num_tokens
            assert len(bm.block_tables[s.seq_id]) * 8 >= s.num_computed_tokens + n
        model = ModelOutput()  # the "model": a token 7 for each sequence that caught up
        model.sampled = [
            Sampled(s, [7], [None]) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens
        ]
        sched.update_from_output(out, model)
        bm.check_invariants()
        if step > 6 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "a request never finished"
    assert all(s.finished for _, s in pending)
    assert bm.num_free_blocks == bm.num_blocks


def step_cost(seq: Sequence, n: int, plp_cost: float) -> int:
    """A chunk's share of the budget: each row that computes a prompt logprob costs extra."""
    rows = 0
    if seq.params.prompt_logprobs is not None:
        rows = min(n, max(0, len(seq.prompt_token_ids) - 1 - seq.num_computed_tokens))
    return math.ceil(n + rows * plp_cost)


def test_a_prompt_logprobs_prompt_is_prefilled_in_chunks_that_leave_room_for_decodes() -> None:
    sched = Scheduler(BlockManager(400, 16, watermark=0.0), 64, 512, prompt_logprob_cost=1.0)
    long = Sequence("plp", 0, [2] * 1500, SamplingParams(max_tokens=4, prompt_logprobs=20), 0.0)
    chunks = _chunks_beside_streams(sched, long)
    # 16 decode tokens, then each prompt token and its logprob row count twice in 512
    assert max(chunks) == (512 - 16) // 2


def test_a_long_prompt_arrives_in_small_chunks_while_streams_decode_and_whole_when_none_do() -> None:
    sched = Scheduler(BlockManager(400, 16, watermark=0.0), 64, 512, prefill_tokens_while_decoding=128)
    alone = Sequence("alone", 0, [3] * 1500, SamplingParams(max_tokens=1), 0.0)
    sched.add(alone)
    assert [n for _, n in sched.schedule().scheduled] == [512], "nothing decodes: the whole budget"
    sched.remove(alone)
    long = Sequence("long", 0, [2] * 1500, SamplingParams(max_tokens=4), 0.0)
    assert max(_chunks_beside_streams(sched, long)) == 128


def _chunks_beside_streams(
    sched: Scheduler, long: Sequence, step_s: Callable[[SchedulerOutput], float] | None = None
) -> list[int]:
    """The chunks `long` is prefilled in when it arrives while 16 streams decode (after their
    prompts and one decode-only step), every stream decoding in every step; `step_s` as `_run`."""
    streams = [Sequence(f"d{i}", 0, [1] * 20, SamplingParams(max_tokens=500), 0.0) for i in range(16)]
    for s in streams:
        sched.add(s)
    _run(sched, step_s)  # the streams' prompts
    _run(sched, step_s)  # a decode-only step (what the pacer takes the decodes' share from)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < len(long.prompt_token_ids):
        got = {s.request_id: n for s, n in _run(sched, step_s)}
        assert all(got[s.request_id] == 1 for s in streams), "every stream decodes in every step"
        chunks.append(got[long.request_id])
    assert sum(chunks) == len(long.prompt_token_ids)
    return chunks


def _paced_chunks(unit_s: float, target_ms: float = 50.0) -> list[int]:
    """The chunks of a 1,500-token prompt arriving while 16 streams decode, with a stand-in
    model whose step takes 30 ms when it decodes plus `unit_s` per prompt token."""
    sched = Scheduler(
        BlockManager(400, 16, watermark=0.0),
        64,
        512,
        prefill_tokens_while_decoding=256,
        cost=StepCost(prefill_ms_while_decoding=target_ms),
    )
    long = Sequence("long", 0, [2] * 1500, SamplingParams(max_tokens=4), 0.0)
    return _chunks_beside_streams(
        sched, long, lambda out: (0.030 if out.num_decodes else 0.0) + unit_s * out.prefill_cost
    )


def test_a_step_that_decodes_keeps_its_prompt_work_to_the_time_allowed() -> None:
    # 2 ms a prompt token: 50 ms is 25 tokens a step, once the first step beside the decodes (the
    # floor: the streams' own prompts, alone in their step, teach nothing of it) has measured it
    chunks = _paced_chunks(0.002)
    assert chunks[0] == MIN_UNITS and set(chunks[1:-1]) == {25}, chunks
    # a token far dearer than the target (a huge context, a loaded machine): still the floor a step
    assert set(_paced_chunks(1.0)[:-1]) == {MIN_UNITS}
    # cheap tokens (a GPU): the token cap (256) bounds the chunk, not the time
    assert max(_paced_chunks(1e-5)) == 256
    # the time bound off: the token cap alone
    assert max(_paced_chunks(0.002, target_ms=0.0)) == 256


def test_one_stalled_decode_step_does_not_make_prompt_work_look_free() -> None:
    """The amplification trace of 2026-11-28: a decode-only step held 1.2 s by a GIL
    (the first structured request's tokenizer index) became the decodes' cost in a moving
    average, every later step's prompt work looked free, and 128-row prompt-logprob chunks
    (450 ms) rode beside the streams again. The decodes' share is a median."""
    pacer = StepCost(50.0)
    for ms in [30, 29, 31, 30, 1261, 30]:
        pacer.observe(StepWork(0, 16), ms / 1000)
    assert pacer.decode_ms == 30
    for _ in range(3):  # 20 units beside the decodes, 2 ms each
        pacer.observe(StepWork(20, 16), (30 + 20 * 2) / 1000)
    assert pacer.prompt_units(decoding=True) == 25


def test_the_first_prompt_work_beside_measured_decodes_is_the_floor() -> None:
    """Until a prompt unit's cost is known, a step beside streams whose decodes are
    measured takes the floor, and that step gives the estimate: the first prompt-logprobs
    chunk beside 16 streams (nothing bounding it) took 61 tokens and 116 ms, 8x their
    gap. With no decode-only step seen there is nothing to compare with: the token cap."""
    pacer = StepCost(20.0)
    assert pacer.prompt_units(decoding=True) == math.inf  # nothing measured
    for _ in range(5):
        pacer.observe(StepWork(0, 16), 0.015)
    assert pacer.prompt_units(decoding=True) == MIN_UNITS
    pacer.observe(StepWork(MIN_UNITS, 16), (15 + MIN_UNITS * 2) / 1000)  # 2 ms a unit
    assert pacer.prompt_units(decoding=True) == 10
    assert StepCost(0.0).prompt_units(decoding=True) == math.inf  # no time bound asked for


def test_a_quiet_stretch_forgets_a_prompt_units_cost() -> None:
    """A unit's cost learned for one prompt priced the next one, after a stretch of
    decode-only steps, at another context and load: its first chunk beside 16 streams
    took 62 tokens and 69 ms, 1.6x the decode-only step before it (bench/amplification.py). After
    DECODE_SAMPLES decode-only steps in a row, the next prompt starts at the floor."""
    from wsllm.engine.step_cost import DECODE_SAMPLES

    pacer = StepCost(20.0)
    for _ in range(5):
        pacer.observe(StepWork(0, 16), 0.015)
    pacer.observe(StepWork(MIN_UNITS, 16), (15 + MIN_UNITS * 0.5) / 1000)  # 0.5 ms a unit: 40 units fit
    assert pacer.prompt_units(decoding=True) == 40
    for _ in range(DECODE_SAMPLES - 1):  # a few decode-only steps between chunks: kept
        pacer.observe(StepWork(0, 16), 0.015)
    assert pacer.prompt_units(decoding=True) == 40
    pacer.observe(StepWork(0, 16), 0.015)
    assert pacer.prompt_units(decoding=True) == MIN_UNITS


def test_preemption_takes_the_newest_and_puts_it_first_in_waiting() -> None:
    bm = BlockManager(4, 8, watermark=0.0)
    sched = Scheduler(bm, 8, 64)
    a = Sequence("a", 0, [1] * 15, SamplingParams(max_tokens=20), 0.0)
    b = Sequence("b", 0, [2] * 15, SamplingParams(max_tokens=20), 0.0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a", "b"]
    sched.update_from_output(out, ModelOutput([Sampled(s, [5], [None]) for s, _ in out.scheduled]))
    # both now need a third block; only... 4 blocks total, each holds 2: a grows, b goes
    for s in (a, b):
        s.output_token_ids.append(5)
        s.num_computed_tokens += 1
    out = sched.schedule()
    assert out.preempted == [b]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    assert [s.request_id for s, _ in out.scheduled] == ["a"]


def _run(
    sched: Scheduler, step_s: Callable[[SchedulerOutput], float] | None = None
) -> list[tuple[Sequence, int]]:
    """One step with a stand-in model (a token for every sequence that caught up): what it
    scheduled. `step_s`, when given, is the step's time, reported to the pacer."""
    out = sched.schedule()
    model = ModelOutput()
    model.sampled = [
        Sampled(s, [5], [None]) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens
    ]
    sched.update_from_output(out, model)
    if step_s is not None:
        sched.cost.observe(out.work, step_s(out))
    return out.scheduled


def _step(sched: Scheduler) -> list[str]:
    """One step with a stand-in model: the request ids it scheduled."""
    return [s.request_id for s, _ in _run(sched)]


def test_a_higher_priority_request_goes_before_lower_ones_that_waited_longer() -> None:
    sched = Scheduler(BlockManager(64, 8, watermark=0.0), 1, 64)
    for rid, priority in [("old-low", 0), ("older-low", 0), ("new-high", 5), ("newest-mid", 2)]:
        sched.add(Sequence(rid, 0, [1] * 4, SamplingParams(max_tokens=1), 0.0, priority=priority))
    started = []
    while sched.has_unfinished():
        for s in list(sched.running):  # max_tokens=1: done after its first step
            s.status = SeqStatus.FINISHED
        sched.update_from_output(SchedulerOutput(), ModelOutput())
        started += _step(sched)
    assert started == ["new-high", "newest-mid", "old-low", "older-low"]


def test_the_lowest_priority_is_preempted_first_even_when_it_is_older() -> None:
    bm = BlockManager(4, 8, watermark=0.0)
    sched = Scheduler(bm, 8, 64)
    low = Sequence("low", 0, [1] * 15, SamplingParams(max_tokens=20), 0.0, priority=0)
    high = Sequence("high", 0, [2] * 15, SamplingParams(max_tokens=20), 0.0, priority=1)
    sched.add(low)
    sched.add(high)
    assert _step(sched) == ["high", "low"]  # priority orders admission too
    for s in (low, high):  # both need a third block; 4 blocks hold two each
        s.output_token_ids.append(5)
        s.num_computed_tokens += 1
    out = sched.schedule()
    assert out.preempted == [low] and [s.request_id for s, _ in out.scheduled] == ["high"]


def _admission_order(tenant_b: str) -> list[str]:
    sched = Scheduler(BlockManager(256, 8, watermark=0.0), 2, 256)
    for i in range(8):
        sched.add(Sequence(f"a{i}", 0, [1] * 4, SamplingParams(max_tokens=3), 0.0, tenant="a"))
    started = _step(sched)
    for i in range(2):  # b comes once a's first two run and six more of a's wait
        sched.add(Sequence(f"b{i}", 0, [2] * 4, SamplingParams(max_tokens=3), 0.0, tenant=tenant_b))
    while sched.has_unfinished():
        for s in list(sched.running):
            if len(s.output_token_ids) >= 3:
                s.status = SeqStatus.FINISHED
        sched.update_from_output(SchedulerOutput(), ModelOutput())
        started += [r for r in _step(sched) if r not in started]
    return started


def test_a_tenant_that_arrives_later_is_served_before_the_backlog_of_a_busy_one() -> None:
    assert _admission_order("b")[:4] == ["a0", "a1", "b0", "b1"]  # the next free slots
    assert _admission_order("a")[-2:] == ["b0", "b1"]  # one tenant: first come, first served


def test_a_batch_whose_decodes_take_longer_than_the_target_gives_prompts_as_long() -> None:
    """A step that decodes may take about twice a decode-only step: 32 streams decoding in
    80 ms give a prompt 80 ms beside them, not the 50 ms target (which bounds the prompt work
    beside a small batch); the streams' gap at most about doubles either way."""
    pacer = StepCost(50.0)
    for _ in range(5):
        pacer.observe(StepWork(0, 32), 0.080)
    pacer.observe(StepWork(20, 32), (80 + 20 * 2) / 1000)  # 2 ms a unit beside the decodes
    assert pacer.prompt_units(decoding=True) == 40
    small = StepCost(50.0)
    for _ in range(5):
        small.observe(StepWork(0, 4), 0.020)
    small.observe(StepWork(20, 4), (20 + 20 * 2) / 1000)
    assert small.prompt_units(decoding=True) == 25
