"""KV sharing in the engine: prefix caching, n > 1 with copy-on-write, chunked prefill."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module", params=["dense", "quantized"])
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_gguf_path: Path) -> Path:
    """Each test twice: on the tiny model's float weights, and on the same model as a
    GGUF of Q4_0/Q8_0 blocks computed in those blocks."""
    return tiny_model_dir if request.param == "dense" else tiny_gguf_path


def make_engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(path), **({"dtype": "float32"} | kw)))  # type: ignore[arg-type]


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def finish(engine: LLMEngine, peak: list[int] | None = None) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    bm = engine.block_manager
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        if peak is not None:
            peak.append(bm.num_blocks - bm.num_free_blocks)
    return out


def test_prefix_cache_second_request_computes_only_new_tokens(
    tiny_model_dir: Path, record_steps: Callable[[LLMEngine], list[dict[str, int]]]
) -> None:
    system = rand_tokens(500, 1)
    a, b = system + rand_tokens(9, 2), system + rand_tokens(13, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    on = make_engine(tiny_model_dir, kv_cache_gb=0.05, block_size=16)
    step_log = record_steps(on)
    on.add_request(GenerateRequest("a", a, greedy))
    first = finish(on)
    on.add_request(GenerateRequest("b", b, greedy))
    second = finish(on)
    computed_b = sum(step.get("b/0", 0) for step in step_log)
    hit = (500 // 16) * 16
    # b computes its prompt past the cached blocks, then one token per output but the last
    assert computed_b == len(b) - hit + 15
    assert on.stats().prefix_hit_tokens >= hit
    off = make_engine(tiny_model_dir, kv_cache_gb=0.05, block_size=16, enable_prefix_caching=False)
    off.add_request(GenerateRequest("a", a, greedy))
    off.add_request(GenerateRequest("b", b, greedy))
    assert finish(off) == {**first, **second}
    on.block_manager.check_invariants()
    assert on.block_manager.num_free_blocks == on.block_manager.num_blocks


def test_n4_seeded_is_batch_invariant_shares_blocks_and_copies_on_write(tiny_model_dir: Path) -> None:
    prompt = rand_tokens(70, 4)  # 4 full blocks of 16 and a partial one
    p4 = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    e = make_engine(tiny_model_dir, kv_cache_gb=0.05, block_size=16, enable_prefix_caching=False)
    e.add_request(
        GenerateRequest("one", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    )
    single_peak: list[int] = []
    finish(e, single_peak)
    e.add_request(GenerateRequest("x", prompt, p4))
    peak: list[int] = []
    alone = finish(e, peak)["x"]
    assert len(alone) == 4 and len({tuple(t) for t in alone}) > 1
    assert e.stats().num_cow > 0
    assert max(peak) < 4 * max(single_peak)
    for i in range(8):
        e.add_request(
            GenerateRequest(
                f"o{i}", rand_tokens(10 + 7 * i, 20 + i), SamplingParams(temperature=0.8, max_tokens=12)
            )
        )
    e.add_request(GenerateRequest("x", prompt, p4))
    assert finish(e)["x"] == alone
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    e.block_manager.check_invariants()


def test_chunked_prefill_keeps_decodes_streaming(
    tiny_model_dir: Path, record_steps: Callable[[LLMEngine], list[dict[str, int]]]
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    shorts = [rand_tokens(8 + i, 30 + i) for i in range(8)]
    long = rand_tokens(2000, 99)
    e = make_engine(tiny_model_dir, kv_cache_gb=0.1, max_num_batched_tokens=256)
    step_log = record_steps(e)
    for i, p in enumerate(shorts):
        e.add_request(GenerateRequest(f"s{i}", p, greedy))
    e.step()  # the 8 prompts are computed and now decode
    e.add_request(
        GenerateRequest("long", long, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    )
    start = len(step_log)
    got = finish(e)
    steps = step_log[start:]
    chunks = [s["long/0"] for s in steps if "long/0" in s]
    assert len(chunks) > 5, "the long prompt was not split over steps"
    prefill_steps = [s for s in steps if s.get("long/0", 0) > 1]
    for s in prefill_steps:
        alive = [k for k in s if k.startswith("s")]
        assert all(s[k] == 1 for k in alive)
    assert sum(1 for s in prefill_steps if len([k for k in s if k.startswith("s")]) == 8) >= 5
    ref = make_engine(tiny_model_dir, kv_cache_gb=0.1, max_num_batched_tokens=4096)
    for i, p in enumerate(shorts):
        ref.add_request(GenerateRequest(f"s{i}", p, greedy))
    ref.add_request(
        GenerateRequest("long", long, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    )
    assert finish(ref) == got
