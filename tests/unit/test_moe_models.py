"""Mixtures of experts, one tiny random-weight model per family built by transformers in the test
(OLMoE, Qwen3-MoE with a leading dense layer, Mixtral, Granite-MoE-Shared with its multipliers and
shared expert; each with 5 experts and top-k of 2 or 3): greedy tokens equal HF `generate` in fp32;
the same weights as a GGUF (Q4_0 and Q8_0 inside, experts included; Granite's gate and up experts
fused) load with the experts in their blocks and give logits within the dense path's tolerance of
the file's de-quantized run; a file that disagrees with its counts is refused naming it; the
decode stack runs an MoE model's layers (the MoE op, Granite's scales) with the layer-by-layer bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from wsllm.kernels import quant

from wsllm import LLM, SamplingParams
from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.models.gguf_checks import GGUFError
from wsllm.models.quant_linear import QuantExpertsModule
from wsllm.types import GenerateRequest

KINDS = ["olmoe", "qwen3_moe", "mixtral", "granitemoeshared"]


def hf_greedy(hf: Any, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def prompts(lengths: tuple[int, ...] = (3, 17, 40), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (n,), generator=g).tolist() for n in lengths]


def make_engine(model: Path, **kw: Any) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model), dtype="float32", kv_cache_gb=0.05, **kw))


def prompt_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    engine.add_request(GenerateRequest("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            got = o.prompt_logprobs if o.prompt_logprobs is not None else got
    assert got is not None
    return torch.tensor([p[0] for p in got[1:]])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_generate(kind: str, tiny_moe: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_moe(kind)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(model=str(path), kv_cache_gb=0.05, dtype="float32", kv_cache_dtype="float32")
    batch = prompts()
    results = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for ids, r in zip(batch, results, strict=True):
        assert r.token_ids == hf_greedy(hf, ids, 16)
    assert len({t for r in results for t in r.token_ids}) > 8, "a model that repeats itself tests little"


@pytest.mark.parametrize("kind", KINDS)
def test_its_gguf_runs_in_its_blocks_within_the_dense_tolerance(
    kind: str, tiny_moe: Any, tiny_moe_gguf: Any
) -> None:
    """The quantized run against the file's de-quantized run (the dense path's bound: 0.1 nats on
    average, 1 at most); and that de-quantized run against the HF weights it was written from (the
    loader's names and Q/K un-permutation: a wrong reading moves it by nats)."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    path = tiny_moe_gguf(kind)
    blocks, dense = make_engine(path), make_engine(path, quantization="none")
    experts = [m for m in blocks.runner.model.modules() if isinstance(m, QuantExpertsModule)]
    assert experts and {m.qexperts.gate.qtype for m in experts} == {"Q4_0"}
    assert {m.qexperts.down.qtype for m in experts} == {"Q8_0"}
    ids = prompts((60,), seed=1)[0]
    quantized, dequantized = prompt_logprobs(blocks, ids), prompt_logprobs(dense, ids)
    diff = (quantized - dequantized).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0, (diff.mean(), diff.max())
    hf = prompt_logprobs(make_engine(tiny_moe(kind)), ids)
    assert (dequantized - hf).abs().mean() < 0.2


def _refused(tmp_path: Path, like: Any, kind: str, change: Any) -> GGUFError:
    path = like(tmp_path / f"{kind}-bad.gguf", kind, change)
    with pytest.raises(GGUFError) as e:
        make_engine(path)
    assert str(path) in str(e.value)
    return e.value


def test_a_file_that_disagrees_with_its_counts_is_refused_naming_it(
    tmp_path: Path, moe_gguf_like: Any
) -> None:
    def more_used(name: str, x: Any) -> Any:
        if name == "(metadata)":
            x.add_expert_used_count(6)  # of 5
        return x

    e = _refused(tmp_path, moe_gguf_like, "olmoe", more_used)
    assert e.tensor == "blk.0.ffn_gate_inp.weight" and "olmoe.expert_used_count is 6" in str(e)

    def four_experts(name: str, x: Any) -> Any:
        return x[:4] if name == "blk.1.ffn_down_exps.weight" else x

    e = _refused(tmp_path, moe_gguf_like, "mixtral", four_experts)
    assert e.tensor == "blk.1.ffn_down_exps.weight" and "5 experts" in str(e)

    e = _refused(
        tmp_path,
        moe_gguf_like,
        "qwen3_moe",
        lambda name, x: None if name == "blk.1.ffn_up_exps.weight" else x,
    )
    assert e.tensor == "blk.1.ffn_up_exps.weight" and "missing" in str(e)


def test_the_decode_stack_runs_an_moe_models_layers_with_their_bits(tiny_moe_gguf: Any) -> None:
    """Granite-MoE-Shared's decode-only steps in the one native call (its MoE op, its residual
    multiplier's scales, its shared expert) give the layer-by-layer logits, bit for bit."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    got = {}
    for fused in (True, False):
        engine = make_engine(tiny_moe_gguf("granitemoeshared"), enable_prefix_caching=False)
        model = engine.runner.model
        model.fused_decode = fused
        seen: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda h, seen=seen, compute=compute: seen.append(compute(h)) or seen[-1]  # type: ignore[method-assign]
        for i, p in enumerate(prompts((3, 9, 5))):
            engine.add_request(
                GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            )
        while engine.has_unfinished():
            engine.step()
        assert (model._stack is not None and model._stack[2] is not None) == fused
        got[fused] = seen
    assert len(got[True]) == len(got[False]) > 3
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)
