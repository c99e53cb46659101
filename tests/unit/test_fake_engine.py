"""The fake engine (wsllm/engine/fake.py) keeps LLMEngine's contract as the worker uses
it: one token per running request per step up to max_tokens, room that shrinks and
comes back, an abort reported by the next step, and what LLMEngine refuses refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsllm.engine.fake import FakeEngine, fake_token_ids
from wsllm.types import EngineBusy, GenerateRequest, SamplingParams


@pytest.fixture
def fake(smollm_dir: Path) -> FakeEngine:
    return FakeEngine(smollm_dir, "fake", 0.1, max_num_seqs=2, max_waiting=1)


def test_tokens_run_to_max_tokens_and_room_comes_back(fake: FakeEngine, smollm_dir: Path) -> None:
    fake.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, n=2)))
    fake.add_request(GenerateRequest("b", [1], SamplingParams(max_tokens=12)))
    assert fake.free_capacity() == 0
    got: dict[tuple[str, int], list[int]] = {}
    finish = {}
    while fake.has_unfinished():
        for out in fake.step():
            for c in out.outputs:
                got.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
                finish[(out.request_id, c.index)] = c.finish_reason
    ids = fake_token_ids(smollm_dir)
    assert got == {("a", 0): ids[:3], ("a", 1): ids[:3], ("b", 0): (ids * 2)[:12]}
    assert set(finish.values()) == {"length"}
    assert fake.free_capacity() == 2 and fake.stats().num_running == 0


def test_an_abort_is_reported_by_the_next_step(fake: FakeEngine) -> None:
    fake.add_request(GenerateRequest("a", [1], SamplingParams(max_tokens=100)))
    fake.step()
    assert fake.abort("a") and not fake.abort("a")
    (out,) = fake.step()
    assert (out.request_id, out.finished, out.outputs[0].finish_reason) == ("a", True, "abort")
    assert not fake.has_unfinished() and fake.stats().num_aborted_total == 1


def test_it_refuses_what_the_engine_refuses(fake: FakeEngine) -> None:
    with pytest.raises(ValueError, match="context"):
        fake.add_request(GenerateRequest("long", [1] * 8190, SamplingParams(max_tokens=100)))
    with pytest.raises(ValueError, match="token ids"):
        fake.add_request(GenerateRequest("bad", [10**6], SamplingParams()))
    for rid in ("a", "b", "c"):
        fake.add_request(GenerateRequest(rid, [1], SamplingParams()))
    with pytest.raises(ValueError, match="in use"):
        fake.add_request(GenerateRequest("a", [1], SamplingParams()))
    with pytest.raises(EngineBusy):
        fake.add_request(GenerateRequest("d", [1], SamplingParams()))
