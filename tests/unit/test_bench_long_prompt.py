"""bench/long_prompt.py's pieces, without measuring anything: on the tiny model both phases run to
the long prompt's first token and free every block, the prompt is prefilled in chunks of the step
budget while the streams beside it keep getting tokens, and `add` speaks both signatures of
`add_request` (one GenerateRequest, or the loose arguments of before)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.types import GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("long_prompt", ROOT / "bench" / "long_prompt.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_both_phases_run_to_the_first_token_and_free_everything(
    bench: ModuleType, tiny_model_dir: Path
) -> None:
    cfg = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        cpu_gemm="torch",
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    engine = LLMEngine.from_config(cfg)
    args = argparse.Namespace(prompt_len=300)
    alone = bench.run_phase(engine, args, 0, 0)
    beside = bench.run_phase(engine, args, 3, 1)
    for phase in (alone, beside):
        assert phase.ttft_s > 0
        assert len(phase.steps_s) >= 300 // 64, "prefilled in chunks of the step budget"
    assert alone.gap_s == 0 and beside.gap_s > 0, "the streams beside it got tokens meanwhile"
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    row = bench.best([alone])
    assert row["steps"] == len(alone.steps_s) and row["longest step s"] == max(alone.steps_s)


class LooseEngine:
    """An engine of before: add_request(request_id, prompt_token_ids, params)."""

    def __init__(self) -> None:
        self.got: list[Any] = []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.got.append((request_id, prompt_token_ids, params))


class WholeEngine:
    def __init__(self) -> None:
        self.got: list[Any] = []

    def add_request(self, request: GenerateRequest) -> None:
        self.got.append(request)


def test_add_speaks_both_signatures(bench: ModuleType) -> None:
    params = SamplingParams(max_tokens=2)
    loose, whole = LooseEngine(), WholeEngine()
    bench.add(loose, "a", [1, 2], params)
    bench.add(whole, "a", [1, 2], params)
    assert loose.got == [("a", [1, 2], params)]
    assert whole.got == [GenerateRequest("a", [1, 2], params)]
