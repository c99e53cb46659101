"""A sequence's stop checks (Sequence.append_token): EOS and stop tokens past
min_tokens, ignore_eos, max_tokens and the model's context."""

from __future__ import annotations

from wsllm.engine.sequence import SeqStatus, Sequence
from wsllm.types import FINISH_LENGTH, FINISH_STOP, SamplingParams

EOS = 2


def run(params: SamplingParams, tokens: list[int], max_model_len: int = 100) -> Sequence:
    seq = Sequence("r", 0, [7, 7, 7], params, 0.0)
    for t in tokens:
        assert not seq.finished, "tokens after the end"
        assert seq.append_token(t, None, [EOS], max_model_len) is None
    return seq


def test_eos_stops_only_past_min_tokens_and_not_with_ignore_eos() -> None:
    assert run(SamplingParams(), [5, EOS]).finish_reason == FINISH_STOP
    assert run(SamplingParams(min_tokens=3), [EOS, EOS]).finish_reason is None
    assert run(SamplingParams(ignore_eos=True, max_tokens=9), [EOS, EOS]).finish_reason is None


def test_a_stop_token_stops_and_the_length_limits_end_it() -> None:
    seq = run(SamplingParams(stop_token_ids=[9]), [5, 9])
    assert (seq.finish_reason, seq.status, seq.output_token_ids) == (FINISH_STOP, SeqStatus.FINISHED, [5, 9])
    assert run(SamplingParams(max_tokens=2), [5, 6]).finish_reason == FINISH_LENGTH
    assert run(SamplingParams(max_tokens=50), [5, 6], max_model_len=5).finish_reason == FINISH_LENGTH


def test_logprobs_are_kept_per_new_token() -> None:
    seq = Sequence("r", 0, [7], SamplingParams(), 0.0)
    seq.append_token(5, [-0.5, []], [EOS], 100)
    assert seq.new_logprobs == [[-0.5, []]] and seq.new_token_ids == [5]
