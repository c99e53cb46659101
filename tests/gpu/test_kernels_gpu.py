"""The Triton kernels compiled for CUDA, against their torch references.

Same grid as tests/unit/test_kernels*.py (wsllm.kernels.testing), but full rather
than pairwise for prefill, and with bf16 at its real tolerance: on the GPU the
fp32 -> bf16 conversion rounds to nearest. Run: `pytest -m gpu tests/gpu`.
Skipped without CUDA, and when TRITON_INTERPRET=1 is set in this process (then
the kernels would run in the interpreter, not on the GPU).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 in this process: run `pytest -m gpu tests/gpu` on its own",
    ),
]

from wsllm.kernels import activation, kv_store, norms, paged_attention, rotary  # noqa: E402
from wsllm.kernels.testing import (  # noqa: E402
    BLOCK_SIZES,
    GQA_RATIOS,
    HEAD_DIMS,
    PREFILL_SCENARIOS,
    edge_lens,
    kv_heads_for,
    make_paged_case,
    prefill_batch,
    row_op_tolerance,
    tolerance,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
CUDA = "cuda"


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tolerance(dtype))


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", [*HEAD_DIMS, 80, 96])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    case = make_paged_case(
        edge_lens(block_size), None, block_size, kv_heads_for(group), group, head_dim, dtype, CUDA
    )
    out = paged_attention.paged_decode_attention_triton(*case.decode_args())
    _close(out, paged_attention.paged_decode_attention_ref(*case.decode_args()), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 33])
def test_decode_split_count_does_not_change_the_result(num_splits: int) -> None:
    case = make_paged_case(edge_lens(16), None, 16, 2, 3, 128, torch.bfloat16, CUDA, seed=1)
    out = paged_attention.paged_decode_attention_triton(*case.decode_args(), num_splits=num_splits)
    _close(out, paged_attention.paged_decode_attention_ref(*case.decode_args()), torch.bfloat16)


@pytest.mark.parametrize(
    ("block_size", "group", "scenario", "head_dim", "dtype"),
    list(itertools.product(BLOCK_SIZES, GQA_RATIOS, PREFILL_SCENARIOS, HEAD_DIMS, DTYPES)),
)
def test_prefill_matches_reference(
    block_size: int, group: int, scenario: str, head_dim: int, dtype: torch.dtype
) -> None:
    lens, q_lens = prefill_batch(scenario, block_size)
    case = make_paged_case(lens, q_lens, block_size, kv_heads_for(group), group, head_dim, dtype, CUDA)
    out = paged_attention.paged_prefill_attention_triton(*case.prefill_args())
    _close(out, paged_attention.paged_prefill_attention_ref(*case.prefill_args()), dtype)


# paged_attention.py's variants: a window (the cases' blocks before it are NaN), a soft-cap, sinks
VARIANTS = {
    "window": {"window": 20},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window": 20, "softcap": 1.5, "sinks": True},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_variants_match_reference(num_splits: int | None, variant: str, dtype: torch.dtype) -> None:
    case = make_paged_case(edge_lens(16), None, 16, 2, 4, 128, dtype, CUDA, seed=3, **VARIANTS[variant])
    out = paged_attention.paged_decode_attention_triton(
        *case.decode_args(), **case.variant(), num_splits=num_splits
    )
    _close(out, paged_attention.paged_decode_attention_ref(*case.decode_args(), **case.variant()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", PREFILL_SCENARIOS)
def test_prefill_variants_match_reference(scenario: str, variant: str, dtype: torch.dtype) -> None:
    lens, q_lens = prefill_batch(scenario, 16)
    case = make_paged_case(lens, q_lens, 16, 2, 4, 128, dtype, CUDA, seed=4, **VARIANTS[variant])
    out = paged_attention.paged_prefill_attention_triton(*case.prefill_args(), **case.variant())
    _close(out, paged_attention.paged_prefill_attention_ref(*case.prefill_args(), **case.variant()), dtype)


def test_decode_replays_in_a_cuda_graph() -> None:
    # The launch plan reads shapes only, so one captured graph serves any seq_lens
    # that fit the block table.
    case = make_paged_case([300, 40, 17, 1], None, 16, 8, 4, 128, torch.bfloat16, CUDA, seed=2)
    args = case.decode_args()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention.paged_decode_attention_triton(*args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_decode_attention_triton(*args)
    for lens in ([300, 40, 17, 1], [1, 2, 3, 4], [299, 16, 32, 200]):
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, paged_attention.paged_decode_attention_ref(*args), torch.bfloat16)


# ----------------------------------------------------------------- row ops


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    qkv = torch.randn(7, 12, 128, device=CUDA).to(dtype)
    k, v = qkv[:, 3:6], qkv[:, 9:]
    slots = torch.tensor([0, block_size - 1, block_size, -1, 3 * block_size + 1, 6 * block_size - 1, -1])
    caches = [torch.zeros(6, block_size, 3, 128, device=CUDA, dtype=dtype) for _ in range(4)]
    kv_store.store_kv_triton(k, v, caches[0], caches[1], slots.to(CUDA))
    kv_store.store_kv_ref(k, v, caches[2], caches[3], slots.to(CUDA))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [576, 2048, 4096])
def test_norms_match_reference(hidden: int, dtype: torch.dtype) -> None:
    tol = row_op_tolerance(dtype)
    x = torch.randn(33, hidden, device=CUDA).to(dtype)
    res = (4 * torch.randn(33, hidden, device=CUDA)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=CUDA)).to(dtype)
    torch.testing.assert_close(norms.rms_norm_triton(x, w, 1e-5), norms.rms_norm_ref(x, w, 1e-5), **tol)
    out, h = norms.add_rms_norm_triton(x, res, w, 1e-5)
    ref_out, ref_h = norms.add_rms_norm_ref(x, res, w, 1e-5)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(h, ref_h, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (80, 3), (128, 8)])
def test_rotary_matches_reference(head_dim: int, group: int, dtype: torch.dtype) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256}
    cs = rotary.compute_cos_sin_cache(head_dim, 500000.0, 4096, scaling).to(CUDA)
    positions = torch.randint(0, 4096, (65,), device=CUDA)
    nq = 2 * group
    qkv = torch.randn(65, nq + 4, head_dim, device=CUDA).to(dtype)
    ref = qkv.clone()
    rotary.rotary_embedding_triton(positions, qkv[:, :nq], qkv[:, nq : nq + 2], cs)
    rotary.rotary_embedding_ref(positions, ref[:, :nq], ref[:, nq : nq + 2], cs)
    torch.testing.assert_close(qkv, ref, **row_op_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [1536, 8192, 1000])
def test_silu_and_mul_matches_reference(d: int, dtype: torch.dtype) -> None:
    x = (3 * torch.randn(17, 2 * d, device=CUDA)).to(dtype)
    torch.testing.assert_close(
        activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x), **row_op_tolerance(dtype)
    )
