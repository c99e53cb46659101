"""A request inside the engine (wsllm/engine/request.py): its choices, its prompt
logprobs kept in prompt order across chunks and recomputes and handed over once, and
its step outputs."""

from __future__ import annotations

from wsllm.engine.request import Request
from wsllm.types import FINISH_STOP, SamplingParams


def entry(pos: int) -> list[object]:
    return [-float(pos), []]  # an entry that says which prompt position it is for


def test_choices_wait_to_fork_and_a_beam_search_starts_from_one_sequence() -> None:
    plain = Request.start("r", [1, 2, 3], SamplingParams(n=3), 0.0, 0, "", [0])
    assert [s.index for s in plain.seqs] == [0, 1, 2] and plain.pending == plain.seqs[1:]
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=2, temperature=0.0)
    searched = Request.start("b", [1, 2, 3], beam, 0.0, 0, "", [0])
    assert len(searched.seqs) == 1 and not searched.pending and searched.beam is not None
    assert searched.beam.state.eos_ids == [0]


def test_prompt_logprobs_come_in_order_once_every_prompt_token_has_one() -> None:
    req = Request.start("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), 0.0, 0, "", [0])
    assert req.wants_prompt_logprobs() and req.take_prompt_logprobs() is None
    req.keep_prompt_logprobs(1, [entry(1), entry(2)])  # a first chunk
    assert req.take_prompt_logprobs() is None
    req.keep_prompt_logprobs(1, [entry(1), entry(2), entry(3)])  # a recompute after preemption
    req.keep_prompt_logprobs(3, [entry(3), entry(4)])
    assert not req.wants_prompt_logprobs()
    assert req.take_prompt_logprobs() == [None, entry(1), entry(2), entry(3), entry(4)]
    assert req.take_prompt_logprobs() is None  # once


def test_an_output_reports_new_tokens_once_and_the_queue_time_on_the_first() -> None:
    req = Request.start("r", [1, 2], SamplingParams(max_tokens=2), 10.0, 0, "", [0])
    seq = req.seqs[0]
    seq.first_scheduled_time = 12.5
    assert seq.append_token(4, None, [0], 100) is None
    first = req.output()
    assert first.outputs[0].new_token_ids == [4] and first.queue_time == 2.5 and not first.finished
    assert seq.append_token(0, None, [0], 100) is None  # EOS
    last = req.output()
    assert last.queue_time is None and last.finished
    assert (last.outputs[0].new_token_ids, last.outputs[0].finish_reason) == ([0], FINISH_STOP)
    assert last.outputs[0].token_ids == [4, 0]
    assert req.output().outputs[0].new_token_ids == []
