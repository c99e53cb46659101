"""Triton attention kernels against their torch references, on the CPU.

The kernels run in Triton's interpreter: TRITON_INTERPRET must be set before the
first kernel is defined, which is when a `*_triton` name is first looked up (see
kernels/_lazy.py). The half type here is fp16: the interpreter truncates fp32 ->
bf16 rather than rounding, so bf16 gets one smoke test with a looser tolerance and
its full grid runs in tests/gpu. Tolerances: wsllm.kernels.testing.tolerance().
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the kernels run in Triton's interpreter. Where CUDA is present the
    # kernels compile for it in this process and tests/gpu runs the same grid, so
    # these tests skip unless TRITON_INTERPRET=1 was set from outside.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from wsllm.kernels import paged_attention as pa  # noqa: E402
from wsllm.kernels.paged_decode import plan_splits  # noqa: E402
from wsllm.kernels.testing import (  # noqa: E402
    BLOCK_SIZES,
    GQA_RATIOS,
    HEAD_DIMS,
    PREFILL_PAIRWISE,
    edge_lens,
    kv_heads_for,
    make_paged_case,
    prefill_batch,
    tolerance,
)

from wsllm import kernels  # noqa: E402

HALF = torch.float16
DTYPES = {"fp32": torch.float32, "half": HALF}

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton interpreter is off in this process (with CUDA, tests/gpu runs this grid)",
)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tolerance(dtype, interpreted=True))


# ------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    case = make_paged_case(
        edge_lens(block_size), None, block_size, kv_heads_for(group), group, head_dim, dtype
    )
    out = pa.paged_decode_attention_triton(*case.decode_args())
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 33])
def test_decode_split_count_does_not_change_the_result(num_splits: int) -> None:
    # 1: the direct path without a merge; 7: more splits than the 300-token context
    # fills, so whole splits are empty and must weigh nothing in the merge; 33: the merge
    # takes the splits in three chunks.
    case = make_paged_case(edge_lens(16), None, 16, 2, 3, 64, torch.float32, seed=1)
    out = pa.paged_decode_attention_triton(*case.decode_args(), num_splits=num_splits)
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), torch.float32)


def test_decode_plan_depends_on_shapes_only() -> None:
    # CUDA graphs replay one launch plan: it may not read seq_lens. Off CUDA the plan
    # assumes 16 SMs, 4 programs each.
    cpu = torch.device("cpu")
    assert plan_splits(1, 8, 4096, cpu) == 8  # batch 1: split until the GPU is full
    assert plan_splits(5, 2, 304, cpu) == 5  # no more splits than 64-token tiles
    assert plan_splits(5, 2, 64, cpu) == 1  # one tile is not split
    assert plan_splits(256, 8, 4096, cpu) == 1  # a full batch needs no split


def test_decode_in_a_table_as_wide_as_the_longest_context() -> None:
    # A captured graph's block tables are as wide as max_model_len, so the plan gives
    # every row many splits; each row cuts its own context into them, and a short
    # context's splits past its end must weigh nothing. With 33 splits the 1,100-token row
    # fills 18 of them: the merge's second chunk of 16 carries weight too.
    case = make_paged_case([1, 63, 65, 1100], None, 16, 2, 4, 64, torch.float32, seed=6)
    wide = torch.zeros(4, 128, dtype=torch.int32)  # 2,048 tokens' worth of columns
    wide[:, : case.block_tables.shape[1]] = case.block_tables
    args = list(case.decode_args())
    args[3] = wide
    ref = pa.paged_decode_attention_ref(*case.decode_args())
    assert plan_splits(4, 2, 128 * 16, case.q.device) == 8
    _close(pa.paged_decode_attention_triton(*args), ref, torch.float32)
    _close(pa.paged_decode_attention_triton(*args, num_splits=33), ref, torch.float32)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_decode_pads_head_dim_to_a_power_of_two(head_dim: int) -> None:
    case = make_paged_case(edge_lens(16), None, 16, 2, 3, head_dim, HALF, seed=2)
    out = pa.paged_decode_attention_triton(*case.decode_args())
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), HALF)


def test_decode_bf16_smoke() -> None:
    case = make_paged_case(edge_lens(16), None, 16, 1, 8, 64, torch.bfloat16, seed=3)
    out = pa.paged_decode_attention_triton(*case.decode_args())
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), torch.bfloat16)


def test_decode_reads_a_strided_query() -> None:
    # The model hands over q as a view into the fused qkv projection.
    case = make_paged_case([5, 40], None, 8, 2, 3, 64, torch.float32, seed=4)
    qkv = torch.randn(2, case.q.shape[1] + 4, 64)
    qkv[:, :6] = case.q
    args = list(case.decode_args())
    args[0] = qkv[:, :6]
    out = pa.paged_decode_attention_triton(*args)
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), torch.float32)


# ------------------------------------------------------------------ prefill


@pytest.mark.parametrize(("block_size", "group", "scenario", "head_dim", "precision"), PREFILL_PAIRWISE)
def test_prefill_matches_reference(
    block_size: int, group: int, scenario: str, head_dim: int, precision: str
) -> None:
    dtype = DTYPES[precision]
    lens, q_lens = prefill_batch(scenario, block_size)
    case = make_paged_case(lens, q_lens, block_size, kv_heads_for(group), group, head_dim, dtype)
    out = pa.paged_prefill_attention_triton(*case.prefill_args())
    _close(out, pa.paged_prefill_attention_ref(*case.prefill_args()), dtype)


@pytest.mark.parametrize("max_query_len", [None, 40])
def test_prefill_max_query_len_is_only_a_grid_bound(max_query_len: int | None) -> None:
    # None reads the longest query run from query_start_loc; any upper bound gives
    # the same result (extra query tiles exit at once).
    lens, q_lens = prefill_batch("chunked", 8)
    case = make_paged_case(lens, q_lens, 8, 2, 3, 80, torch.float32, seed=5)
    args = list(case.prefill_args())
    args[-1] = max_query_len
    out = pa.paged_prefill_attention_triton(*args)
    _close(out, pa.paged_prefill_attention_ref(*case.prefill_args()), torch.float32)


def test_prefill_with_one_query_per_sequence_equals_decode() -> None:
    case = make_paged_case(edge_lens(8), [1] * 5, 8, 2, 3, 64, torch.float32, seed=6)
    prefill = pa.paged_prefill_attention_triton(*case.prefill_args())
    decode = pa.paged_decode_attention_triton(*case.decode_args())
    _close(prefill, decode, torch.float32)


def test_prefill_bf16_smoke() -> None:
    lens, q_lens = prefill_batch("chunked", 16)
    case = make_paged_case(lens, q_lens, 16, 2, 3, 64, torch.bfloat16, seed=7)
    out = pa.paged_prefill_attention_triton(*case.prefill_args())
    _close(out, pa.paged_prefill_attention_ref(*case.prefill_args()), torch.bfloat16)


# ------------------------------------------------------- attention variants

# paged_attention.py's window, soft-cap and sinks; the cases' blocks before a window are NaN
VARIANTS = {
    "window": {"window": 20},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window": 20, "softcap": 1.5, "sinks": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_variants_match_reference(variant: str) -> None:
    # 5 splits of the 300-token row (the window's 20 in one); sinks counted once in the merge
    case = make_paged_case(edge_lens(16), None, 16, 2, 3, 64, torch.float32, seed=9, **VARIANTS[variant])
    out = pa.paged_decode_attention_triton(*case.decode_args(), **case.variant())
    _close(out, pa.paged_decode_attention_ref(*case.decode_args(), **case.variant()), torch.float32)


@pytest.mark.parametrize(("num_splits", "dtype"), [(1, torch.float32), (33, HALF)], ids=["single", "33-fp16"])
def test_decode_variants_in_one_split_and_many(num_splits: int, dtype: torch.dtype) -> None:
    case = make_paged_case(
        edge_lens(8), None, 8, 1, 8, 64, dtype, seed=10, window=37, softcap=2.0, sinks=True
    )
    out = pa.paged_decode_attention_triton(*case.decode_args(), **case.variant(), num_splits=num_splits)
    _close(out, pa.paged_decode_attention_ref(*case.decode_args(), **case.variant()), dtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_variants_match_reference_across_the_window(variant: str) -> None:
    # chunks of 37 and 9 queries whose windows start inside earlier blocks, decodes, a fresh prompt
    lens, q_lens = prefill_batch("chunked", 8)
    case = make_paged_case(lens, q_lens, 8, 2, 3, 64, torch.float32, seed=11, **VARIANTS[variant])
    out = pa.paged_prefill_attention_triton(*case.prefill_args(), **case.variant())
    _close(out, pa.paged_prefill_attention_ref(*case.prefill_args(), **case.variant()), torch.float32)


def test_prefill_variants_fp16_with_fresh_prompts_longer_than_the_window() -> None:
    lens, q_lens = prefill_batch("prefill", 16)
    case = make_paged_case(lens, q_lens, 16, 1, 8, 128, HALF, seed=12, window=24, softcap=2.0, sinks=True)
    out = pa.paged_prefill_attention_triton(*case.prefill_args(), **case.variant())
    _close(out, pa.paged_prefill_attention_ref(*case.prefill_args(), **case.variant()), HALF)


# ----------------------------------------------------------------- dispatch


def test_backend_triton_dispatches_to_the_kernels() -> None:
    case = make_paged_case([3, 20], None, 8, 2, 1, 64, torch.float32, seed=8)
    try:
        kernels.use_backend("triton")
        out = kernels.paged_decode_attention(*case.decode_args())
        assert kernels._impl("paged_decode_attention", case.q.device) is pa.paged_decode_attention_triton
    finally:
        kernels.use_backend("auto")
    assert kernels._impl("paged_decode_attention", case.q.device) is pa.paged_decode_attention_ref
    _close(out, pa.paged_decode_attention_ref(*case.decode_args()), torch.float32)


def test_import_is_lazy_and_falls_back_without_triton() -> None:
    # Importing wsllm.kernels does not import triton; with triton missing the
    # *_triton names are absent and the dispatcher uses the reference.
    code = (
        "import sys\n"
        "from wsllm import kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "sys.modules['triton'] = None\n"
        "from wsllm.kernels import norms, paged_attention\n"
        "assert getattr(paged_attention, 'paged_decode_attention_triton', None) is None\n"
        "assert getattr(norms, 'rms_norm_triton', None) is None\n"
        "try:\n"
        "    kernels.use_backend('triton')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('use_backend(triton) accepted without triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
