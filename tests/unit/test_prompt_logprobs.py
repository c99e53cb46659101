"""Prompt logprobs (`SamplingParams.prompt_logprobs`): computed during prefill, whole or
in chunks, equal to the log_softmax of HF's logits over the prompt, returned once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.outputs import RequestOutput
from wsllm.types import GenerateRequest, SamplingParams

LENGTHS = [1, 2, 9, 40, 75]
TOPS = [0, 3, 20, 5, 1]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def make_engine(path: Path, **kw: Any) -> LLMEngine:
    # HF's fp32 log-softmax within 1e-4: the cache in fp32 too (auto may pick float16)
    cfg = {"dtype": "float32", "kv_cache_dtype": "float32"} | kw
    return LLMEngine.from_config(EngineConfig(model=str(path), **cfg))


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """request id -> (its outputs in order, its output tokens)."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerateRequest(f"r{i}", p, sp))
    outs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
    return {rid: (outs[rid], tokens[rid]) for rid in outs}


def the_prompt_logprobs(outs: list[RequestOutput]) -> list[Any]:
    carrying = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1, "prompt logprobs come exactly once"
    assert outs[0].prompt_logprobs is not None, "on the first output"
    return carrying[0]


def assert_equals_hf(hf: Any, ids: list[int], got: list[Any], top: int, first_token: int) -> None:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]
    assert first_token == int(logits[-1].argmax()), "the sampled token is unchanged"
    lp = logits[:-1].log_softmax(dim=-1)  # row p: the distribution of prompt token p + 1
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        chosen, pairs = got[p]
        assert chosen == pytest.approx(float(lp[p - 1, ids[p]]), abs=1e-4), p
        want_v, want_i = lp[p - 1].topk(top)
        assert [t for t, _ in pairs] == want_i.tolist(), p
        assert [v for _, v in pairs] == pytest.approx(want_v.tolist(), abs=1e-4), p


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf_log_softmax(
    tiny_model_dir: Path, hf: Any, chunked: bool, record_steps: Callable[[LLMEngine], list[dict[str, int]]]
) -> None:
    budget = 16 if chunked else 2048  # 16: the 40- and 75-token prompts take several steps
    engine = make_engine(tiny_model_dir, kv_cache_gb=0.05, max_num_batched_tokens=budget)
    step_log = record_steps(engine)
    prompts = prompts_of(LENGTHS)
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in TOPS]
    results = run(engine, prompts, params)
    prefill_steps = sum(1 for step in step_log if step.get("r4/0", 1) > 1)
    assert prefill_steps > 1 if chunked else prefill_steps == 1
    for i, (ids, top) in enumerate(zip(prompts, TOPS, strict=True)):
        outs, tokens = results[f"r{i}"]
        assert_equals_hf(hf, ids, the_prompt_logprobs(outs), top, tokens[0])


def test_a_request_without_them_gets_none(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, kv_cache_gb=0.05)
    ((outs, _),) = run(engine, prompts_of([30]), [SamplingParams(temperature=0.0, max_tokens=2)]).values()
    assert all(o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_skip_the_prefix_cache_and_leave_it_to_others(tiny_model_dir: Path, hf: Any) -> None:
    engine = make_engine(tiny_model_dir, kv_cache_gb=0.05, enable_prefix_caching=True)
    ids = prompts_of([50])[0]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    wants = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    run(engine, [ids], [plain])  # fills the cache with the prompt's full blocks
    ((outs, tokens),) = run(engine, [ids], [wants]).values()
    assert outs[-1].num_cached_tokens == 0, "every prompt position was computed"
    assert_equals_hf(hf, ids, the_prompt_logprobs(outs), 2, tokens[0])
    ((outs, _),) = run(engine, [ids], [plain]).values()
    assert outs[-1].num_cached_tokens == 48, "the cache still serves requests that do not ask"


def test_prompt_logprobs_survive_recompute_preemption(tiny_model_dir: Path, hf: Any) -> None:
    # 24 blocks of 8 tokens for about 60 blocks of work, prompts in chunks of 16 tokens
    engine = make_engine(
        tiny_model_dir,
        num_kv_blocks=24,
        block_size=8,
        watermark=0.0,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        preemption_mode="recompute",
    )
    prompts = prompts_of([20, 35, 50, 12, 64, 28])
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    results = run(engine, prompts, [params] * len(prompts))
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    for i, ids in enumerate(prompts):
        outs, tokens = results[f"r{i}"]
        assert_equals_hf(hf, ids, the_prompt_logprobs(outs), 1, tokens[0])
