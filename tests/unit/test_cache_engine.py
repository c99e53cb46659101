"""KV cache sizing (cache_engine.num_kv_blocks): an explicit block count wins, else
the memory budget; CPU swap blocks only when preemption swaps."""

from __future__ import annotations

import torch

from wsllm.config import EngineConfig
from wsllm.engine.cache_engine import bytes_per_block, num_kv_blocks
from wsllm.models.llama import ModelConfig

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
