"""The whole engine runs with the Triton kernels in the interpreter (CPU), and its
greedy tokens equal those of the torch-reference path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: @jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from wsllm import kernels  # noqa: E402
from wsllm.config import EngineConfig  # noqa: E402
from wsllm.engine.engine import LLMEngine  # noqa: E402
from wsllm.types import GenerateRequest, SamplingParams  # noqa: E402


def make(path: Path, backend: str, **kw: object) -> LLMEngine:
    cfg = EngineConfig(
        model=str(path), kv_cache_gb=0.02, block_size=16, attention_backend=backend, dtype="float32", **kw
    )  # type: ignore[arg-type]
    return LLMEngine.from_config(cfg)


def greedy_tokens(path: Path, backend: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    return run(make(path, backend), prompts)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", p, params))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU-only machines")
@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen3_dir"])
def test_engine_with_triton_interpreter_equals_torch_path(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(5)
    # mixed lengths: a block boundary, a decode-only step, and a chunk past one block
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 15, 17, 40)]
    try:
        ref = greedy_tokens(path, "torch", prompts)
        tri = greedy_tokens(path, "triton", prompts)
    finally:
        kernels.use_backend("auto")
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert tri == ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is for CPU-only machines")
def test_speculative_verification_rows_through_the_paged_kernels(tiny_llama3_dir: Path) -> None:
    """A sequence verifying k drafts is a row of k + 1 queries over its cached context: on
    CUDA the paged prefill kernel runs it. Greedy tokens equal the torch path's without drafts."""
    prompts = [[1, 504, 3456, 77, 504, 3456, 77, 504], [5, 600, 7000, 42] * 5]
    try:
        ref = run(make(tiny_llama3_dir, "torch"), prompts, max_tokens=24)
        engine = make(tiny_llama3_dir, "triton", speculative="ngram", speculative_adaptive=False)
        tri = run(engine, prompts, max_tokens=24)
    finally:
        kernels.use_backend("auto")
    assert tri == ref
    assert 0 < engine.spec.stats.accepted < engine.spec.stats.drafted
