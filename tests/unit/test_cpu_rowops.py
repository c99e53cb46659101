"""The native row ops of the CPU decode step (kernels/cpu/rowops.cpp), each against the
unfused torch reference it replaces: RMSNorm with the residual add and SiLU*up (fp32 and
bf16, the references' rounding, within row_op_tolerance), rotary with the KV store (fp32
and bf16, the same bits; into a float16 cache, or bf16 under fp32, rounded as torch's .to())."""

from __future__ import annotations

import pytest
import torch
from wsllm.kernels import activation, cpu_ops, native, norms, quant
from wsllm.kernels.cpu_attention import plan_cpu_attention, rotate
from wsllm.kernels.rotary import compute_cos_sin_cache
from wsllm.kernels.testing import row_op_tolerance

from wsllm import kernels

ext = native.extension()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native build: {native.failure()}")


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("m", [1, 3, 200])  # 200 rows: split over the threads
def test_bf16_rms_norm_with_and_without_the_residual_equals_the_reference(m: int) -> None:
    x, r = _rows(m, 576, torch.bfloat16, 0), _rows(m, 576, torch.bfloat16, 1)
    w = (1 + 0.1 * _rows(1, 576, torch.float32, 2)[0]).to(torch.bfloat16)
    out, h = kernels.add_rms_norm(x, r, w, 1e-5)
    want, want_h = norms.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(h, want_h), "x + residual is rounded as torch rounds"
    torch.testing.assert_close(out, want, **row_op_tolerance(torch.bfloat16))
    torch.testing.assert_close(
        kernels.rms_norm(x, w, 1e-5), norms.rms_norm_ref(x, w, 1e-5), **row_op_tolerance(torch.bfloat16)
    )
    assert torch.equal(x, _rows(m, 576, torch.bfloat16, 0)), "inputs are not modified"


@pytest.mark.parametrize("m", [1, 40])
def test_bf16_silu_and_mul_equals_the_reference(m: int) -> None:
    x = 3 * _rows(m, 2 * 1536, torch.bfloat16, 3)
    got = cpu_ops.silu_and_mul_cpu(x)
    torch.testing.assert_close(got, activation.silu_and_mul_ref(x), **row_op_tolerance(torch.bfloat16))


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("isa", quant.ISAS)
@pytest.mark.parametrize("k", [576, 100])  # 100: a tail past the last whole vector
def test_rms_norm_on_every_isa_path_equals_the_reference(isa: str, k: int, dtype: torch.dtype) -> None:
    try:
        quant.force_isa(isa)
    except RuntimeError:
        pytest.skip(f"the {isa} path cannot run here")
    x, r = _rows(33, k, dtype, 7), _rows(33, k, dtype, 8)
    x[0] *= 1e-3  # mean square near eps: a wrong eps or mean shows there
    w = (1 + 0.1 * _rows(1, k, torch.float32, 9)[0]).to(dtype)
    try:
        out, h = kernels.add_rms_norm(x, r, w, 1e-5)
        plain = kernels.rms_norm(x, w, 1e-5)
    finally:
        quant.force_isa(None)
    want, want_h = norms.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(h, want_h), "x + residual is rounded as torch rounds"
    torch.testing.assert_close(out, want, **row_op_tolerance(dtype))
    torch.testing.assert_close(plain, norms.rms_norm_ref(x, w, 1e-5), **row_op_tolerance(dtype))


@DTYPES
@pytest.mark.parametrize("isa", quant.ISAS)
@pytest.mark.parametrize("d", [1536, 100])  # 100: a tail past the last whole vector
def test_silu_and_mul_on_every_isa_path_equals_the_reference(isa: str, d: int, dtype: torch.dtype) -> None:
    try:
        quant.force_isa(isa)
    except RuntimeError:
        pytest.skip(f"the {isa} path cannot run here")
    try:
        x = 4 * _rows(33, 2 * d, dtype, 6)
        x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
        assert ext is not None
        got = ext.silu_mul(x, quant.isa_index())
    finally:
        quant.force_isa(None)
    torch.testing.assert_close(got, activation.silu_and_mul_ref(x), **row_op_tolerance(dtype))


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float16),
    ],
)
def test_rope_store_equals_rotate_then_index_copy(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    h, hk, d, bs, t = 9, 3, 64, 16, 5
    qkv = _rows(t, (h + 2 * hk) * d, dtype, 4)
    positions = torch.tensor([0, 7, 31, 100, 2047])
    slots = torch.tensor([3, 17, 40, 41, 63])
    cache = compute_cos_sin_cache(d, 10000.0, 2048, None).to(dtype)  # a bf16 model's buffer is bf16
    plan = plan_cpu_attention([[0]], [1], [1], bs, dtype, positions, cache, slots)
    kc, vc = torch.zeros(4, bs, hk, d, dtype=cache_dtype), torch.zeros(4, bs, hk, d, dtype=cache_dtype)
    want_kc, want_vc, want = kc.clone(), vc.clone(), qkv.clone()
    rotate(want[:, : (h + hk) * d].view(t, h + hk, d), plan)
    want_k, want_v = want[:, h * d : (h + hk) * d].view(t, hk, d), want[:, (h + hk) * d :].view(t, hk, d)
    want_kc.view(-1, hk, d).index_copy_(0, slots, want_k.to(cache_dtype))
    want_vc.view(-1, hk, d).index_copy_(0, slots, want_v.to(cache_dtype))
    assert ext is not None
    ext.rope_store(qkv, plan.cos, plan.sin, kc, vc, slots, h)
    assert torch.equal(qkv, want) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_rope_store_refuses_a_slot_outside_the_cache() -> None:
    qkv = _rows(1, 15 * 64, torch.float32, 5)
    cos = sin = torch.zeros(1, 64)
    kc = vc = torch.zeros(2, 16, 3, 64)
    assert ext is not None
    with pytest.raises(IndexError):
        ext.rope_store(qkv, cos, sin, kc, vc, torch.tensor([32]), 9)
