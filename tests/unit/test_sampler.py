"""The batched sampler's rules, on hand-made logits."""

from __future__ import annotations

import torch

from wsllm.bounds import MAX_TOP_K
from wsllm.engine.sampler import Sampler
from wsllm.engine.sequence import Sequence
from wsllm.types import SamplingParams


def seq(**kw: object) -> Sequence:
    return Sequence("r", 0, [1, 2, 3], SamplingParams(**kw), 0.0)  # type: ignore[arg-type]


def test_greedy_top_k_top_p_min_p_restrict_the_choice() -> None:
    s = Sampler(vocab_size=8, eos_token_ids=[0])
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0, 1.0, 1.0, 1.0, 1.0]]).repeat(4, 1)
    rows = [
        seq(temperature=0.0),
        seq(temperature=1.0, top_k=1),
        seq(temperature=1.0, top_p=0.3),
        seq(temperature=1.0, min_p=0.95),
    ]
    for _ in range(20):
        assert s(logits, rows).token_ids == [1, 1, 1, 1]
    # top_k=2 only ever picks the two best
    picks = {s(logits[:1], [seq(temperature=5.0, top_k=2)]).token_ids[0] for _ in range(60)}
    assert picks == {1, 2}


def test_greedy_picks_what_torch_argmax_picks_ties_and_nan_included() -> None:
    s = Sampler(vocab_size=6, eos_token_ids=[0])
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 3.0, -1.0, 0.0, 9.0],  # a tie (the first wins); the padded column is cut
            [-inf, -inf, -inf, -inf, -inf, -inf, 0.0],
            [1.0, nan, 5.0, nan, 2.0, 0.0, 0.0],
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0],
        ]
    )
    rows = [seq(temperature=0.0) for _ in range(4)]
    got = s(logits, rows).token_ids
    assert got == logits[:, :6].argmax(dim=-1).tolist() == [1, 0, 1, 5]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    s = Sampler(vocab_size=4, eos_token_ids=[0])
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    r = seq(temperature=0.0, min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert s(logits, [r]).token_ids == [1]
    r.output_token_ids = [1, 1]
    assert s(logits, [r]).token_ids == [0]


def test_penalties_push_away_repeated_tokens() -> None:
    s = Sampler(vocab_size=4, eos_token_ids=[])
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    r = seq(temperature=0.0, frequency_penalty=1.0)
    r.output_token_ids = [1]
    assert s(logits, [r]).token_ids == [2]
    r2 = seq(temperature=0.0, repetition_penalty=1.5)
    r2.prompt_token_ids = [1]
    assert s(logits, [r2]).token_ids == [2]


def test_logprobs_are_normalised_and_sorted() -> None:
    s = Sampler(vocab_size=5, eos_token_ids=[])
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    res = s(logits, [seq(temperature=0.0, logprobs=3)])
    chosen, top = res.logprobs[0]
    assert [t for t, _ in top] == [1, 2, 0]
    assert abs(chosen - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6
    assert abs(sum(torch.tensor([v for _, v in top]).exp().tolist()) - 0.9) < 0.1


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    s = Sampler(vocab_size=8, eos_token_ids=[0])
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for t in (1e-300, 1e-9, 5e-6):  # 1/t overflows the logits to inf; inf - inf is NaN
        assert s(logits, [seq(temperature=t)]).token_ids == [1]
    assert s(logits, [seq(temperature=t, logprobs=2)]).logprobs[0][1][0][0] == 1


def test_top_k_beyond_the_vocabulary_means_no_limit() -> None:
    s = Sampler(vocab_size=8, eos_token_ids=[0])
    logits = torch.zeros(1, 8)
    picks = {s(logits, [seq(temperature=1.0, top_k=MAX_TOP_K)]).token_ids[0] for _ in range(200)}
    assert len(picks) >= 6  # every token stays possible
