"""Triton row-wise ops (store_kv, rms_norm, add_rms_norm, rotary_embedding,
silu_and_mul) against their torch references, on the CPU in Triton's interpreter.

Tolerances: exact for store_kv (a copy), wsllm.kernels.testing.row_op_tolerance()
for the rest. As in test_kernels.py, the half type with a full grid is fp16 and
bf16 gets a looser interpreter tolerance because the interpreter truncates.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the kernels run in Triton's interpreter. Where CUDA is present the
    # kernels compile for it in this process and tests/gpu runs the same grid, so
    # these tests skip unless TRITON_INTERPRET=1 was set from outside.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from wsllm.kernels import activation, kv_store, norms, rotary  # noqa: E402
from wsllm.kernels.testing import BLOCK_SIZES, HEAD_DIMS, row_op_tolerance  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton interpreter is off in this process (with CUDA, tests/gpu runs this grid)",
)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **row_op_tolerance(ref.dtype, interpreted=True))


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv_writes_exactly_the_reference_slots(
    block_size: int, head_dim: int, dtype: torch.dtype
) -> None:
    num_kv_heads, num_blocks = 3, 6
    # k and v are views into a fused qkv row, as the model hands them over
    qkv = _randn(7, 4 * num_kv_heads, head_dim, dtype=dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    # slots across block boundaries, a block's last offset, and -1 (skip)
    bs = block_size
    slots = torch.tensor([0, bs - 1, bs, -1, 3 * bs + 1, 5 * bs + bs - 1, -1])
    caches = [torch.zeros(num_blocks, bs, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    kv_store.store_kv_triton(k, v, caches[0], caches[1], slots)
    kv_store.store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ----------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_matches_reference(hidden: int, dtype: torch.dtype) -> None:
    x = _randn(5, hidden, dtype=dtype) * 3
    w = 1 + 0.1 * _randn(hidden, dtype=dtype, seed=1)
    _close(norms.rms_norm_triton(x, w, 1e-5), norms.rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_add_rms_norm_matches_reference(hidden: int, dtype: torch.dtype) -> None:
    x = _randn(5, hidden, dtype=dtype)
    res = _randn(5, hidden, dtype=dtype, seed=2) * 4
    w = 1 + 0.1 * _randn(hidden, dtype=dtype, seed=1)
    x_before, res_before = x.clone(), res.clone()
    out, h = norms.add_rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_h = norms.add_rms_norm_ref(x, res, w, 1e-6)
    _close(out, ref_out)
    _close(h, ref_h)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


def test_rms_norm_promotes_like_the_reference() -> None:
    # fp16 activations with an fp32 weight give an fp32 result, as in torch
    x = _randn(3, 96, dtype=torch.float16)
    w = 1 + 0.1 * _randn(96, dtype=torch.float32, seed=1)
    _close(norms.rms_norm_triton(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6))


# ------------------------------------------------------------------- rotary

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("head_dim", "group", "scaling"), [(64, 1, None), (80, 3, LLAMA3), (128, 8, LLAMA3)])
def test_rotary_matches_reference_in_place(
    head_dim: int, group: int, scaling: dict | None, dtype: torch.dtype
) -> None:
    num_kv_heads, t = 2, 9
    cs = rotary.compute_cos_sin_cache(head_dim, 500000.0, 2048, scaling)
    positions = torch.tensor([0, 1, 2, 255, 256, 1000, 2047, 7, 7])
    nq = num_kv_heads * group
    qkv = _randn(t, nq + 2 * num_kv_heads, head_dim, dtype=dtype)
    ref = qkv.clone()
    rotary.rotary_embedding_triton(positions, qkv[:, :nq], qkv[:, nq : nq + num_kv_heads], cs)
    rotary.rotary_embedding_ref(positions, ref[:, :nq], ref[:, nq : nq + num_kv_heads], cs)
    _close(qkv, ref)  # v (the last heads) is untouched by both


# ------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [64, 1000, 2560])
def test_silu_and_mul_matches_reference(d: int, dtype: torch.dtype) -> None:
    x = _randn(4, 2 * d, dtype=dtype) * 3
    _close(activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x))
