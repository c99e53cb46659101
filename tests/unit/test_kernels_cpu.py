"""The CPU fast paths (kernels/cpu_ops.py, kernels/cpu_attention.py) against the
references they replace on CPU tensors. The fp32 row ops run natively when the C++ build
is there (a vector exp, another order of the sum of squares): within row_op_tolerance of
the references, the residual sum exact; attention may differ by summation order."""

from __future__ import annotations

import pytest
import torch
from wsllm.kernels import activation, cpu_ops, norms, rotary
from wsllm.kernels.cpu_attention import cpu_paged_attention, plan_cpu_attention
from wsllm.kernels.kv_store import store_kv_ref
from wsllm.kernels.paged_attention import paged_prefill_attention_ref
from wsllm.kernels.testing import (
    PREFILL_SCENARIOS,
    make_paged_case,
    prefill_batch,
    row_op_tolerance,
    tolerance,
)


def test_fp32_row_ops_are_within_1e5_of_the_references_and_the_residual_sum_exact() -> None:
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(7, 96, generator=g), torch.randn(7, 96, generator=g)
    x[0] *= 1e-3  # a row whose mean square is near eps: a wrong eps or mean shows there
    x[1] *= 300.0
    w = torch.randn(96, generator=g)
    tol = row_op_tolerance(torch.float32)
    torch.testing.assert_close(cpu_ops.rms_norm_cpu(x, w, 1e-5), norms.rms_norm_ref(x, w, 1e-5), **tol)
    out, h = cpu_ops.add_rms_norm_cpu(x, 1e-3 * r, w, 1e-6)
    want, want_h = norms.add_rms_norm_ref(x, 1e-3 * r, w, 1e-6)
    assert torch.equal(h, want_h), "x + residual is exact"
    torch.testing.assert_close(out, want, **tol)
    gate_up = 4 * torch.randn(7, 2 * 96, generator=g)
    torch.testing.assert_close(cpu_ops.silu_and_mul_cpu(gate_up), activation.silu_and_mul_ref(gate_up), **tol)


@pytest.mark.parametrize("layout", ["fused qkv", "separate"])
def test_rotary_matches_the_reference_on_qkv_views_and_separate_tensors(layout: str) -> None:
    t, h, hk, d = 5, 6, 2, 64
    g = torch.Generator().manual_seed(1)
    cache = rotary.compute_cos_sin_cache(d, 10000.0, 64, None)
    pos = torch.tensor([0, 3, 17, 40, 63])
    qkv = torch.randn(t, (h + 2 * hk) * d, generator=g)
    expect = qkv.clone()
    views = []
    for buf in (qkv, expect):
        if layout == "fused qkv":  # the model's case: q and k side by side in one row
            q, k = buf[:, : h * d].view(t, h, d), buf[:, h * d : (h + hk) * d].view(t, hk, d)
        else:
            q, k = buf[:, : h * d].clone().view(t, h, d), buf[:, (h + hk) * d :].clone().view(t, hk, d)
        views.append((q, k))
    assert (cpu_ops._side_by_side(*views[0]) is not None) == (layout == "fused qkv")
    cpu_ops.rotary_embedding_cpu(pos, *views[0], cache)
    rotary.rotary_embedding_ref(pos, *views[1], cache)
    for a, b in zip(views[0], views[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(qkv[:, (h + hk) * d :], expect[:, (h + hk) * d :]), "v was touched"


def test_store_kv_writes_the_slots_and_skips_minus_one() -> None:
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    for slots in ([5, 0, 9, 3], [5, -1, 9, -1]):
        caches = [torch.zeros(3, 4, 2, 8) for _ in range(4)]
        sm = torch.tensor(slots)
        cpu_ops.store_kv_cpu(k, v, caches[0], caches[1], sm)
        store_kv_ref(k, v, caches[2], caches[3], sm)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _new_kv(
    cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int], q_lens: list[int]
) -> torch.Tensor:
    """The K (or V) rows of each sequence's last q_len positions, as the projection made them."""
    bs = cache.shape[1]
    rows = []
    for t, ctx, n in zip(tables, seq_lens, q_lens, strict=True):
        rows += [cache[t[p // bs], p % bs] for p in range(ctx - n, ctx)]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", PREFILL_SCENARIOS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_cpu_attention_matches_the_reference(scenario: str, block_size: int, dtype: torch.dtype) -> None:
    seq_lens, q_lens = prefill_batch(scenario, block_size)
    c = make_paged_case(seq_lens, q_lens, block_size, num_kv_heads=2, group=3, head_dim=64, dtype=dtype)
    tables = [
        row[: (n + block_size - 1) // block_size]
        for row, n in zip(c.block_tables.tolist(), seq_lens, strict=True)
    ]
    k, v = _new_kv(c.k_cache, tables, seq_lens, q_lens), _new_kv(c.v_cache, tables, seq_lens, q_lens)
    plan = plan_cpu_attention(c.block_tables.tolist(), seq_lens, q_lens, block_size, dtype)
    out = cpu_paged_attention(c.q, k, v, c.k_cache, c.v_cache, plan, c.scale)
    ref = paged_prefill_attention_ref(*c.prefill_args())
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_a_pure_decode_batch_reads_only_the_columns_it_needs() -> None:
    # Tables longer than the contexts (blocks reserved ahead) must not widen the gather.
    c = make_paged_case([3, 20, 9], None, 8, num_kv_heads=1, group=4, head_dim=64, dtype=torch.float32)
    long_tables = [row + [0, 0, 0] for row in c.block_tables.tolist()]
    plan = plan_cpu_attention(long_tables, [3, 20, 9], [1, 1, 1], 8)
    assert plan.num_decodes == 3 and plan.width == 3 and not plan.prefills
    out = cpu_paged_attention(c.q, c.q[:, :1], c.q[:, :1], c.k_cache, c.v_cache, plan, c.scale)
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(*c.prefill_args()), **tolerance(torch.float32)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_attention_block_equals_rotary_store_and_attention_by_the_references(dtype: torch.dtype) -> None:
    """One layer's CPU attention (rotary on q and k, KV store, attention) from the fused
    qkv output, against the three references run one after the other."""
    from wsllm.kernels.cpu_attention import cpu_attention_block

    bs, hk, group, d = 8, 2, 3, 64
    h = hk * group
    seq_lens, q_lens = prefill_batch("mixed", bs)
    c = make_paged_case(seq_lens, q_lens, bs, num_kv_heads=hk, group=group, head_dim=d, dtype=dtype)
    t = sum(q_lens)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (h + 2 * hk) * d, generator=g).to(dtype)
    tables = c.block_tables.tolist()
    positions, slots = [], []
    for row, ctx, n in zip(tables, seq_lens, q_lens, strict=True):
        positions += list(range(ctx - n, ctx))
        slots += [row[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
    pos, sm = torch.tensor(positions), torch.tensor(slots)
    cache = rotary.compute_cos_sin_cache(d, 10000.0, 512, None)
    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    plan = plan_cpu_attention(tables, seq_lens, q_lens, bs, dtype, pos, cache, sm)
    out = cpu_attention_block(qkv.clone(), kc, vc, plan, h, c.scale)
    ref_qkv = qkv.clone()
    q = ref_qkv[:, : h * d].view(t, h, d)
    k = ref_qkv[:, h * d : (h + hk) * d].view(t, hk, d)
    v = ref_qkv[:, (h + hk) * d :].view(t, hk, d)
    rotary.rotary_embedding_ref(pos, q, k, cache)
    store_kv_ref(k, v, c.k_cache, c.v_cache, sm)
    assert torch.equal(kc, c.k_cache) and torch.equal(vc, c.v_cache), "the cache holds the same K and V"
    ref = paged_prefill_attention_ref(
        q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.query_start_loc, c.scale
    )
    torch.testing.assert_close(out, ref.reshape(t, h * d), **tolerance(dtype))
