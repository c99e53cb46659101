"""The engine's features on a mixture of experts: a mixed batch (a prefix hit, a long prompt in
chunks, n = 2, preemption by recompute and by swap) gives each request what it gets alone, on the
float experts and on the quantized ones (the grouped native pass); n-gram speculation gives the
tokens without it; LoRA adapters on the attention projections equal PEFT's, and one that targets
the experts is refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from wsllm import LLM, SamplingParams
from wsllm.models.lora import AdapterError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2048, (n,), generator=g).tolist() for n in lengths]


def tokens(results: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in r.outputs] for r in results]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(
    source: str, tiny_moe: Any, tiny_moe_gguf: Any
) -> None:
    model = str(tiny_moe("qwen3_moe") if source == "hf" else tiny_moe_gguf("qwen3_moe"))
    shared = prompts((40,), seed=1)[0]
    long_prompt, a, b = prompts((150, 7, 12), seed=2)
    asks = [shared + [5, 6], long_prompt, a, b]  # the first hits the prefix the warm-up leaves
    two = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    params = [GREEDY, GREEDY, two, GREEDY]
    ref = LLM(model=model, dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=64)
    ref.generate([shared + [9]], GREEDY)
    alone = [tokens(ref.generate([p], sp))[0] for p, sp in zip(asks, params, strict=True)]
    assert alone[2][0] == alone[2][1]
    for mode in ("recompute", "swap"):
        small = LLM(
            model=model, dtype="float32", num_kv_blocks=24, block_size=8, max_num_seqs=4,
            max_num_batched_tokens=64, preemption_mode=mode,
        )  # fmt: skip
        small.generate([shared + [9]], GREEDY)
        results = small.generate(asks, params)
        assert tokens(results) == alone, mode
        assert results[0].num_cached_tokens >= 40 and small.engine.scheduler.num_preemptions > 0, mode
        bm = small.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def test_ngram_speculation_keeps_the_tokens_on_the_grouped_pass(tiny_moe_gguf: Any) -> None:
    model = str(tiny_moe_gguf("olmoe"))
    loop = prompts((6,), seed=3)[0] * 4  # repeats: the n-gram proposer drafts from them
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = LLM(model=model, dtype="float32", kv_cache_gb=0.05, speculative="ngram", speculative_adaptive=False,
               num_speculative_tokens=4)  # fmt: skip
    plain = LLM(model=model, dtype="float32", kv_cache_gb=0.05)
    batch = [loop, loop[:10], prompts((9,), seed=4)[0]]
    assert tokens(spec.generate(batch, params)) == tokens(plain.generate(batch, params))
    assert spec.engine.spec.stats.drafted > 0


def test_lora_on_attention_equals_peft_and_one_on_the_experts_is_refused(
    tmp_path: Path, tiny_moe: Any, lora_factory: Any
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tiny_moe("olmoe")
    attn = lora_factory(tmp_path / "attn", base, 1, r=4, alpha=8, targets=("q_proj", "v_proj", "o_proj"))
    llm = LLM(
        model=str(base), dtype="float32", kv_cache_dtype="float32", kv_cache_gb=0.05, lora=[f"attn={attn}"]
    )
    asks = prompts((5, 11), seed=6)
    got = [r.token_ids for r in llm.generate(asks, GREEDY, lora="attn")]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(attn)
    )
    for ids, out in zip(asks, got, strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():
            want = peft.eval().generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=10,
                                        do_sample=False, pad_token_id=0)  # fmt: skip
        assert out == want[0, len(ids) :].tolist()
    assert got != [r.token_ids for r in llm.generate(asks, GREEDY)]  # the adapter moves the base's answers
    experts = lora_factory(
        tmp_path / "experts", base, 2, r=4, alpha=8, targets=("q_proj", "gate_proj", "up_proj")
    )
    with pytest.raises(AdapterError, match="adapts a mixture's experts"):
        llm.engine.adapters.load("experts", str(experts))
    assert "experts" not in llm.engine.adapters.names()
