"""On CUDA: a tiny mixture of experts (OLMoE; Granite-MoE-Shared with its multipliers and shared
expert; gpt-oss with its biases, sinks and window) through the engine (the Triton fused-MoE kernels,
decode steps replayed from CUDA graphs) gives HF transformers' greedy tokens on CUDA, fp32.
Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

KINDS = {
    "olmoe": dict(num_experts=5, num_experts_per_tok=2),
    "granitemoeshared": dict(
        num_local_experts=5, num_experts_per_tok=2, shared_intermediate_size=32, embedding_multiplier=1.5,
        residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0,
    ),
}  # fmt: skip


def tiny(path: Path, kind: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        kind, vocab_size=2048, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **KINDS[kind],
    )  # fmt: skip
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path))
    return path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", list(KINDS))
def test_moe_greedy_on_cuda_in_graphs_matches_hf(tmp_path: Path, kind: str) -> None:
    greedy_matches_hf(tiny(tmp_path / kind, kind))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_greedy_on_cuda_in_graphs_matches_hf(tiny_gpt_oss: Path) -> None:
    """gpt-oss (tests/conftest.py: tiny_gpt_oss): the Triton fused MoE with the experts' biases and
    the clamped SwiGLU, sinks and a window shorter than the prompts in the Triton attention."""
    greedy_matches_hf(tiny_gpt_oss)


def greedy_matches_hf(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import GenerateRequest, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=8
        )
    )
    assert engine.runner.static is not None and engine.runner.static.graphs is not None  # decode in graphs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    for i, p in enumerate(prompts):
        engine.add_request(
            GenerateRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                max_new_tokens=20, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert got[str(i)] == out[0, len(p) :].tolist()
