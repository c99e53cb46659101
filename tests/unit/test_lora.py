"""LoRA adapters in the engine, with PEFT as the oracle: greedy tokens of four adapters and
the base mixed in one batch equal Hugging Face transformers with PEFT's adapter (fp32, the
de-quantized path); on a quantized base a request's tokens are the same in a mixed batch as
alone, through the native decode stack and layer by layer; the same prompt under two
adapters and the base never shares a prefix-cache block; speculative decoding, n > 1,
beams, structured output and preemption (recompute and swap) keep each adapter's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from wsllm import LLM, SamplingParams
from wsllm.types import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
#: four adapters unlike each other: every projection, attention only (rsLoRA), the MLP only, q and v
SPECS = {
    "all8": dict(r=8, alpha=16),
    "attn4": dict(r=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), rslora=True),
    "mlp16": dict(r=16, alpha=8, targets=("gate_proj", "up_proj", "down_proj")),
    "qv2": dict(r=2, alpha=4, targets=("q_proj", "v_proj")),
}


@pytest.fixture(scope="module")
def adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, lora_factory: Any
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: lora_factory(root / name, tiny_model_dir, seed, **spec)
        for seed, (name, spec) in enumerate(SPECS.items())
    }


def prompts(n: int, seed: int = 0, length: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + i,), generator=g).tolist() for i in range(n)]


def peft_greedy(
    base_dir: Path, adapters: dict[str, Path], asks: list[tuple[list[int], str]]
) -> list[list[int]]:
    """Hugging Face transformers with PEFT's adapters, one request at a time (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    model.eval()
    out = []
    for ids, name in asks:
        kwargs: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        x = torch.tensor([ids])
        with torch.no_grad():
            if name:
                model.set_adapter(name)
                got = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs)
            else:
                with model.disable_adapter():
                    got = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs)
        out.append(got[0, len(ids) :].tolist())
    return out


def lora_flags(adapters: dict[str, Path]) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


def test_four_adapters_and_the_base_in_one_batch_equal_peft(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    asks = [(ids, name) for name in ["", *adapters] for ids in prompts(2)]
    llm = LLM(
        model=str(tiny_model_dir), quantization="none", dtype="float32", kv_cache_dtype="float32",
        kv_cache_gb=0.05, lora=lora_flags(adapters),
    )  # fmt: skip
    got = [r.token_ids for r in llm.generate([ids for ids, _ in asks], GREEDY, lora=[n for _, n in asks])]
    assert got == peft_greedy(tiny_model_dir, adapters, asks)
    base = got[:2]
    for i in range(1, len(SPECS) + 1):  # each adapter moves the base's answers (else this could not fail)
        assert got[2 * i : 2 * i + 2] != base, asks[2 * i][1]


@pytest.fixture(scope="module")
def quantized(tiny_gguf_path: Path, adapters: dict[str, Path]) -> LLM:
    """The tiny GGUF (tiny_model_dir's weights in Q4_0/Q8_0 blocks) with the four adapters."""
    return LLM(model=str(tiny_gguf_path), dtype="float32", kv_cache_gb=0.05, lora=lora_flags(adapters))


def test_on_the_quantized_base_a_request_gets_the_same_tokens_in_a_mixed_batch_as_alone(
    quantized: LLM,
) -> None:
    from wsllm.kernels import quant

    assert quant.kernel_path() != "torch"  # the native kernels, where rows must not see each other
    names = ["", *SPECS]
    asks = [(ids, names[i % len(names)]) for i, ids in enumerate(prompts(10, seed=7))]
    alone = [quantized.generate([ids], GREEDY, lora=name)[0].token_ids for ids, name in asks]
    mixed = quantized.generate([ids for ids, _ in asks], GREEDY, lora=[name for _, name in asks])
    assert [r.token_ids for r in mixed] == alone
    model = quantized.engine.runner.model
    model.fused_decode = False  # layer by layer: the same kernels, called from Python
    try:
        stepped = quantized.generate([ids for ids, _ in asks], GREEDY, lora=[name for _, name in asks])
    finally:
        model.fused_decode = True
    assert [r.token_ids for r in stepped] == alone
    assert len({tuple(t) for t in alone[: len(names)]}) == len(names)  # every adapter answers its own way


def test_two_adapters_and_the_base_never_share_a_prefix_block(quantized: LLM) -> None:
    prompt = prompts(1, seed=11, length=70)[0]  # four full blocks of 16
    bm = quantized.engine.block_manager
    first = {name: quantized.generate([prompt], GREEDY, lora=name)[0] for name in ("", "all8", "attn4")}
    assert [r.num_cached_tokens for r in first.values()] == [0, 0, 0]  # each computed its own
    again = {name: quantized.generate([prompt], GREEDY, lora=name)[0] for name in ("attn4", "all8", "")}
    for name, r in again.items():  # each hits only its own blocks: the same answer as the first time
        assert r.num_cached_tokens == 64 and r.token_ids == first[name].token_ids, name
    assert bm.num_free_blocks == bm.num_blocks  # what is cached is evictable: nothing held


def test_speculative_decoding_keeps_each_adapters_tokens(
    tiny_gguf_path: Path, adapters: dict[str, Path]
) -> None:
    spec = LLM(
        model=str(tiny_gguf_path), dtype="float32", kv_cache_gb=0.05, lora=lora_flags(adapters),
        speculative="ngram", speculative_adaptive=False, num_speculative_tokens=4,
    )  # fmt: skip
    plain = LLM(model=str(tiny_gguf_path), dtype="float32", kv_cache_gb=0.05, lora=lora_flags(adapters))
    loop = prompts(1, seed=3, length=6)[0] * 4  # repeats: the n-gram proposer drafts from them
    names = ["", *SPECS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = spec.generate([loop] * len(names), params, lora=names)
    want = plain.generate([loop] * len(names), params, lora=names)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert spec.engine.spec.stats.drafted > 0


def test_n_beams_structured_output_and_preemption_run_under_the_adapter(
    tiny_gguf_path: Path, adapters: dict[str, Path], quantized: LLM
) -> None:
    ids = prompts(1, seed=5)[0]
    want = quantized.generate([ids], GREEDY, lora="mlp16")[0].token_ids
    two = quantized.generate(
        [ids], SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True), lora="mlp16"
    )
    assert [c.token_ids for c in two[0].outputs] == [want, want]
    beams = SamplingParams(
        use_beam_search=True, beam_width=2, max_tokens=12, ignore_eos=True, temperature=0.0
    )
    eng, adapter = quantized.engine, quantized.engine.adapters.get("mlp16")
    eng.add_request(GenerateRequest("beams", ids, beams, lora="mlp16"))
    widest = 0
    while eng.has_unfinished():  # every beam, forks included, runs under the adapter, in its namespace
        eng.step()
        if (req := eng._requests.get("beams")) is not None:
            widest = max(widest, len(req.seqs))
            assert all(s.lora is adapter and s.cache_root == req.seqs[0].cache_root for s in req.seqs)
    assert widest == 2
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured={"choice": ["w1 w2", "w3"]})
    assert quantized.generate([ids], choice, lora="all8")[0].text in ("w1 w2", "w3")
    for mode in ("recompute", "swap"):  # 6 blocks for 4 requests of 2-3 blocks each: preemptions
        small = LLM(
            model=str(tiny_gguf_path), dtype="float32", num_kv_blocks=6, block_size=8, max_num_seqs=4,
            preemption_mode=mode, lora=lora_flags(adapters),
        )  # fmt: skip
        names = ["all8", "", "mlp16", "qv2"]
        asks = prompts(4, seed=9)
        got = small.generate(asks, GREEDY, lora=names)
        assert small.engine.scheduler.num_preemptions > 0
        alone = [small.generate([a], GREEDY, lora=n)[0].token_ids for a, n in zip(asks, names, strict=True)]
        assert [r.token_ids for r in got] == alone
        bm = small.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def test_the_stalled_heartbeat_names_the_adapters_a_command_just_changed(
    tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    # The watchdog's last heartbeat (give_up: what /health reads) repeats the worker's last
    # one: after an adapter command that is the command's, not the timed one's before it.
    import asyncio

    from wsllm.broker.memory import MemoryBroker
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine
    from wsllm.engine.worker import EngineWorker
    from wsllm.types import AdapterCommand

    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
            lora=[f"all8={adapters['all8']}"], max_loras=2, allow_adapter_dir=str(adapters["qv2"].parent),
        )
    )  # fmt: skip
    broker = MemoryBroker()
    worker = EngineWorker(engine, broker)
    worker.heartbeat_s = 3600.0  # one timed heartbeat, the first
    worker.run_once()
    broker._commands[None].append(AdapterCommand("c1", "load", "qv2", str(adapters["qv2"])))
    worker.run_once()
    worker.give_up("held on purpose")
    (info,) = asyncio.run(broker.engines())
    assert info.stats["stalled"] == "held on purpose"
    assert sorted(info.adapters) == ["all8", "qv2"]
