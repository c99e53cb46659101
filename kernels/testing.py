"""Random paged-KV cases and the test grid, shared by the CPU tests (interpreter),
the GPU tests and bench/kernels.py, so that all three exercise the same shapes.

A case scatters each sequence's blocks over a shuffled pool with spare blocks, so
a kernel that ignores the block table, or reads one block too far, gets wrong data.
A case with a sliding window points every block that lies wholly before its sequence's
first window at a block of NaNs (the KV manager may have given such a block away), so a
kernel that reads one, even under a mask, answers NaN.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedCase:
    q: torch.Tensor  # decode [num_seqs, num_heads, head_dim]; prefill [num_tokens, ...]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    scale: float
    # the attention variant (paged_attention.py): keyword arguments of every attention path
    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None  # [num_heads] float32

    def variant(self) -> dict:
        return {"window": self.window, "softcap": self.softcap, "sinks": self.sinks}

    def decode_args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale

    def prefill_args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.max_query_len,
        )


def make_paged_case(
    seq_lens: list[int],
    q_lens: list[int] | None,  # None: decode, one query per sequence
    block_size: int,
    num_kv_heads: int,
    group: int,  # query heads per KV head
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    window: int = 0,
    softcap: float = 0.0,
    sinks: bool = False,
) -> PagedCase:
    """A random case; `window`, `softcap` and `sinks` (random logits, drawn after the rest so
    that a case without them is the same) make it one of an attention variant."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    total = sum(blocks) + spare_blocks
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    pool = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks, default=1) or 1, dtype=torch.int32)
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    counts = [1] * len(seq_lens) if q_lens is None else q_lens
    starts = [0, *itertools.accumulate(counts)]
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen)
    sink = torch.randn(num_kv_heads * group, generator=gen) * 2 if sinks else None
    if window > 0:
        k_cache, v_cache = _poison_before_window(k_cache, v_cache, tables, seq_lens, counts, window)
    return PagedCase(
        q=q.to(device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(counts, default=0),
        scale=head_dim**-0.5,
        window=window,
        softcap=softcap,
        sinks=None if sink is None else sink.to(device),
    )


def _poison_before_window(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # changed in place
    seq_lens: list[int],
    q_lens: list[int],
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches with one more block, of NaNs, and the table entries of the blocks wholly before
    each sequence's first query's window pointed at it."""
    bs = k_cache.shape[1]
    nan = torch.full_like(k_cache[:1], torch.nan)
    poison = k_cache.shape[0]
    for s, (ctx, n) in enumerate(zip(seq_lens, q_lens, strict=True)):
        lo = max(0, ctx - n - window + 1)  # the first position any query of the row sees
        tables[s, : lo // bs] = poison
    return torch.cat([k_cache, nan]), torch.cat([v_cache, nan.clone()])


# ---------------------------------------------------------------- the grid

BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 3, 8)
LONG = 300


def edge_lens(block_size: int) -> list[int]:
    """Lengths 1, block_size-1, block_size, block_size+1 and a long one, in one batch."""
    return [1, block_size - 1, block_size, block_size + 1, LONG]


def prefill_batch(scenario: str, block_size: int) -> tuple[list[int], list[int]]:
    """-> (seq_lens, q_lens) for one of three batches that mix short and long sequences.

    "prefill": every sequence is new (q_len == seq_len).
    "chunked": earlier context is cached (chunked prefill, prefix-cache hits).
    "mixed":   decodes (q_len 1) of long sequences beside new short prompts.
    """
    bs = block_size
    if scenario == "prefill":
        lens = edge_lens(bs)
        return lens, list(lens)
    if scenario == "chunked":
        return [bs + 1, LONG, bs, 2 * bs + 3, bs - 1], [1, 37, bs, bs + 1, bs - 1]
    if scenario == "mixed":
        return [LONG, bs + 1, 1, bs, bs - 1], [1, 1, 1, bs, 2]
    raise ValueError(f"unknown prefill scenario {scenario!r}")


PREFILL_SCENARIOS = ("prefill", "chunked", "mixed")

# Pairwise cover of (block_size, gqa, scenario, head_dim, half/full precision):
# every pair of values of any two factors appears in at least one row.
PREFILL_PAIRWISE: tuple[tuple[int, int, str, int, str], ...] = (
    (8, 1, "prefill", 64, "fp32"),
    (8, 3, "chunked", 128, "half"),
    (8, 8, "mixed", 64, "half"),
    (16, 1, "chunked", 64, "half"),
    (16, 3, "mixed", 128, "fp32"),
    (16, 8, "prefill", 128, "half"),
    (32, 1, "mixed", 128, "fp32"),
    (32, 3, "prefill", 64, "half"),
    (32, 8, "chunked", 64, "fp32"),
)


def kv_heads_for(group: int) -> int:
    """Two KV heads (so head offsets are exercised) unless the group is large."""
    return 1 if group >= 8 else 2


def tolerance(dtype: torch.dtype, interpreted: bool = False) -> dict[str, float]:
    """atol/rtol for attention outputs against the fp32-accumulating reference.

    fp32: the kernels use IEEE products, so only summation order differs.
    fp16/bf16: the kernels round the softmax probabilities to the input type before
    the P@V product (as flash attention does) and round the output; allow a few
    ulps. The CPU interpreter truncates fp32 -> bf16 instead of rounding to
    nearest (triton 3.x), which doubles the bf16 error there.
    """
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 3e-3, "rtol": 3e-3}
    if dtype == torch.bfloat16:
        return {"atol": 4e-2, "rtol": 4e-2} if interpreted else {"atol": 2e-2, "rtol": 2e-2}
    raise ValueError(f"no tolerance for {dtype}")


def row_op_tolerance(dtype: torch.dtype, interpreted: bool = False) -> dict[str, float]:
    """atol/rtol for rms_norm, add_rms_norm, rotary_embedding and silu_and_mul.

    The kernels round where the reference rounds, so half types may differ by one
    ulp of the output (a different rsqrt/exp); in the interpreter bf16 by two
    (it truncates fp32 -> bf16). store_kv is a copy and must match exactly.
    """
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.float16:
        return {"atol": 1e-3, "rtol": 1e-3}
    if dtype == torch.bfloat16:
        return {"atol": 1.6e-2, "rtol": 1.6e-2} if interpreted else {"atol": 8e-3, "rtol": 8e-3}
    raise ValueError(f"no tolerance for {dtype}")
