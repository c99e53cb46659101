"""KV cache sizing (cache_engine.num_kv_blocks): an explicit block count wins, else
the memory budget; CPU swap blocks only when preemption swaps. Its dtype
(`--kv-cache-dtype`), and an engine on a float16 cache under a float32 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.cache_engine import bytes_per_block, kv_cache_dtype, num_kv_blocks
from wsllm.engine.engine import LLMEngine
from wsllm.models.config import ModelConfig
from wsllm.types import GenerateRequest, SamplingParams

MC = ModelConfig(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    qkv_bias=False,
)
CPU = torch.device("cpu")


def test_an_explicit_block_count_wins_over_the_budget() -> None:
    cfg = EngineConfig(num_kv_blocks=7, kv_cache_gb=1.0)
    assert num_kv_blocks(cfg, MC, torch.float32, CPU) == (7, 0)


def test_the_cpu_budget_and_the_swap_space_are_cut_into_blocks() -> None:
    per = bytes_per_block(MC, 16, torch.float32)
    assert per == 2 * 2 * 16 * 2 * 16 * 4
    cfg = EngineConfig(block_size=16, kv_cache_gb=0.01, preemption_mode="swap", swap_space_gb=0.001)
    assert num_kv_blocks(cfg, MC, torch.float32, CPU) == (int(0.01 * 2**30) // per, int(0.001 * 2**30) // per)
    recompute = EngineConfig(block_size=16, kv_cache_gb=0.01, preemption_mode="recompute", swap_space_gb=1.0)
    assert num_kv_blocks(recompute, MC, torch.float32, CPU)[1] == 0


def test_auto_halves_a_float32_cache_where_the_native_kernels_read_float16() -> None:
    from wsllm.kernels import cpu_ops

    half = cpu_ops.half_cache_native()
    assert kv_cache_dtype("auto", torch.float32, CPU)[0] == (torch.float16 if half else torch.float32)
    assert kv_cache_dtype("auto", torch.bfloat16, CPU)[0] == torch.bfloat16, "no memory to gain"
    assert kv_cache_dtype("bfloat16", torch.float32, CPU)[0] == torch.bfloat16
    assert bytes_per_block(MC, 16, torch.float16) * 2 == bytes_per_block(MC, 16, torch.float32)
    cfg = EngineConfig(block_size=16, kv_cache_gb=0.01)
    assert num_kv_blocks(cfg, MC, torch.float16, CPU)[0] == int(0.01 * 2**30) // bytes_per_block(
        MC, 16, torch.float16
    )
    with pytest.raises(ValueError, match="only the CPU kernels"):
        kv_cache_dtype("float16", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int8")


def _greedy(engine: LLMEngine, waves: list[list[list[int]]], params: SamplingParams) -> dict[str, list]:
    """Greedy runs, wave after wave (a later wave hits the prefix cache of an earlier one):
    request id -> [(token, its logprob)]."""
    out: dict[str, list] = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(f"w{w}r{i}", p, params))
            out[f"w{w}r{i}"] = []
        while engine.has_unfinished():
            for o in engine.step():
                c = o.outputs[0]
                for tok, (lp, _) in zip(c.new_token_ids, c.new_logprobs or [], strict=True):
                    out[o.request_id].append((tok, lp))
    return out


def test_a_float16_cache_decodes_as_float32_through_prefix_hits_and_swaps(tiny_model_dir: Path) -> None:
    """The engine on a float16 cache under a float32 model (what auto picks on a CPU with
    F16C) against a float32 cache: the same greedy tokens, their logprobs within the
    rounding of K and V, through prefix-cache hits and swap preemption; no block leaked."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 49152, (40,), generator=g).tolist()
    waves = [
        [shared + [7, 8]],
        [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 19, 30)],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    common = dict(model=str(tiny_model_dir), dtype="float32", block_size=8, watermark=0.0)
    ref = LLMEngine.from_config(EngineConfig(**common, kv_cache_dtype="float32", num_kv_blocks=64))
    half = LLMEngine.from_config(
        EngineConfig(**common, kv_cache_dtype="float16", num_kv_blocks=20, preemption_mode="swap")
    )
    assert half.cache.kv_caches[0][0].dtype == torch.float16
    want, got = _greedy(ref, waves, params), _greedy(half, waves, params)
    for rid, toks in want.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in toks], rid
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in got[rid]]), torch.tensor([lp for _, lp in toks]), atol=2e-2, rtol=0
        )
    stats = half.stats()
    assert stats.num_swaps > 0 and stats.prefix_hit_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    swap = half.scheduler.swapper
    assert swap is not None and swap.num_free_blocks == swap.num_blocks, "CPU swap blocks leaked"
    half.block_manager.check_invariants()
