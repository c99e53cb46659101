"""The native paged decode attention (kernels/cpu/attention.cpp) against the torch reference,
on every ISA path this CPU can run: contexts of one token, around a block and long, block
tables scattered over the cache, grouped query heads, fp32 and bf16, head sizes that fill
the vectors and one that leaves the AVX-512 path to the AVX2 one; caches in a half type
under fp32 (or f16 under bf16) queries."""

from __future__ import annotations

import pytest
import torch
from wsllm.kernels import native, quant
from wsllm.kernels.cpu_attention import cpu_paged_attention, plan_cpu_attention
from wsllm.kernels.paged_attention import paged_decode_attention_ref
from wsllm.kernels.testing import edge_lens, make_paged_case, tolerance

ext = native.extension()
pytestmark = pytest.mark.skipif(ext is None, reason=f"no native build: {native.failure()}")


def _isas() -> list[str]:
    out = []
    for isa in quant.ISAS:
        try:
            quant.force_isa(isa)
            out.append(isa)
        except RuntimeError:
            pass
    quant.force_isa(None)
    return out


@pytest.fixture(params=["avx512_vnni", "avx2", "scalar"])
def isa(request):
    if request.param not in _isas():
        pytest.skip(f"the {request.param} path cannot run here")
    quant.force_isa(request.param)
    yield request.param
    quant.force_isa(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (8, 128), (3, 24)])
def test_decode_attention_equals_the_reference(
    isa: str, dtype: torch.dtype, group: int, head_dim: int
) -> None:
    bs = 16
    lens = edge_lens(bs)
    c = make_paged_case(lens, None, bs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    assert ext is not None
    got = ext.decode_attention(
        c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale, quant.isa_index()
    )
    want = paged_decode_attention_ref(*c.decode_args())
    assert got.dtype == dtype
    torch.testing.assert_close(got.view_as(want), want, **tolerance(dtype))


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["fp32-f16", "fp32-bf16", "bf16-f16"],
)
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (3, 24)])  # 24: not the AVX-512 vectors
def test_decode_attention_over_a_half_cache_equals_the_reference(
    isa: str, dtype: torch.dtype, cache_dtype: torch.dtype, group: int, head_dim: int
) -> None:
    """A cache narrower than the queries (--kv-cache-dtype): the kernel widens each K and V
    value exactly, so it equals the reference over the same rounded values widened first."""
    bs = 16
    c = make_paged_case(edge_lens(bs), None, bs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    kc, vc = c.k_cache.to(cache_dtype), c.v_cache.to(cache_dtype)
    kc.view(-1)[:3] = torch.tensor([6e-8, -65504.0, 1e-5])  # a subnormal, the largest half, a small normal
    assert ext is not None
    got = ext.decode_attention(c.q, kc, vc, c.block_tables, c.seq_lens, c.scale, quant.isa_index())
    want = paged_decode_attention_ref(
        c.q.float(), kc.float(), vc.float(), c.block_tables, c.seq_lens, c.scale
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got.view_as(want).float(), want, **tolerance(dtype))


def test_the_plan_sends_decode_rows_to_the_native_kernel_with_strided_queries() -> None:
    # q as the model hands it over: the leading columns of the fused qkv rows
    c = make_paged_case([5, 40, 17], None, 16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16)
    n, h, d = c.q.shape
    qkv = torch.cat([c.q.reshape(n, h * d), torch.randn(n, 6 * d).to(torch.bfloat16)], dim=1)
    q = qkv[:, : h * d].view(n, h, d)
    plan = plan_cpu_attention(c.block_tables.tolist(), [5, 40, 17], [1, 1, 1], 16, torch.bfloat16)
    assert plan.decode_tables is not None and plan.decode_index is None, "no gather index is built"
    out = cpu_paged_attention(q, q, q, c.k_cache, c.v_cache, plan, c.scale)
    want = paged_decode_attention_ref(*c.decode_args())
    torch.testing.assert_close(out, want, **tolerance(torch.bfloat16))


def test_a_table_that_does_not_cover_the_context_is_refused() -> None:
    c = make_paged_case([20], None, 16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32)
    assert ext is not None
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables[:, :1], c.seq_lens, c.scale, 2)
    bad = c.block_tables.clone()
    bad[0, 1] = 10_000
    with pytest.raises(IndexError, match="out of range"):
        ext.decode_attention(c.q, c.k_cache, c.v_cache, bad, c.seq_lens, c.scale, 2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "f16"])
def test_a_decode_step_is_one_native_call_equal_to_the_references(cache_dtype: torch.dtype) -> None:
    """A decode-only step's attention block (rope_store_decode: rotary, the KV store and
    attention in one call) against rotary, store_kv and decode attention by the references;
    a block table it cannot read is refused before the cache is written."""
    from wsllm.kernels.cpu_attention import cpu_attention_block
    from wsllm.kernels.kv_store import store_kv_ref
    from wsllm.kernels.rotary import compute_cos_sin_cache, rotary_embedding_ref

    bs, hk, group, d = 16, 2, 3, 64
    h, lens = hk * group, [1, 17, 40]
    c = make_paged_case(lens, None, bs, num_kv_heads=hk, group=group, head_dim=d, dtype=torch.float32)
    kc, vc = c.k_cache.to(cache_dtype), c.v_cache.to(cache_dtype)
    tables = c.block_tables.tolist()
    pos = torch.tensor([n - 1 for n in lens])
    sm = torch.tensor([row[(n - 1) // bs] * bs + (n - 1) % bs for row, n in zip(tables, lens, strict=True)])
    qkv = torch.randn(3, (h + 2 * hk) * d, generator=torch.Generator().manual_seed(2))
    cache = compute_cos_sin_cache(d, 10000.0, 64, None)
    plan = plan_cpu_attention(tables, lens, [1, 1, 1], bs, torch.float32, pos, cache, sm, cache_dtype)
    assert plan.decode_tables is not None and not plan.prefills
    bad = plan.decode_tables.clone()
    bad[2, 2] = 10_000
    before = kc.clone()
    with pytest.raises(IndexError, match="out of range"):
        assert ext is not None
        ext.rope_store_decode(
            qkv.clone(), plan.cos, plan.sin, kc, vc, sm, h, bad, plan.decode_lens, c.scale, 2
        )
    assert torch.equal(kc, before), "nothing was stored"
    out = cpu_attention_block(qkv.clone(), kc, vc, plan, h, c.scale)
    ref = qkv.clone()
    q, k = ref[:, : h * d].view(3, h, d), ref[:, h * d : (h + hk) * d].view(3, hk, d)
    rotary_embedding_ref(pos, q, k, cache)
    rk, rv = c.k_cache.to(cache_dtype), c.v_cache.to(cache_dtype)
    store_kv_ref(k, ref[:, (h + hk) * d :].view(3, hk, d), rk, rv, sm)
    assert torch.equal(kc, rk) and torch.equal(vc, rv), "the cache holds the same K and V"
    want = paged_decode_attention_ref(q, rk.float(), rv.float(), c.block_tables, c.seq_lens, c.scale)
    torch.testing.assert_close(out, want.reshape(3, h * d), **tolerance(torch.float32))


@pytest.mark.parametrize("fresh", [9, 16, 17], ids=lambda n: f"fresh prompt of {n}")
def test_short_prompt_rows_run_as_decode_rows_whatever_they_are_batched_with(isa: str, fresh: int) -> None:
    """A long prompt's short chunk beside running streams (the step pacer's floor) and a fresh
    prompt: a row of at most SHORT_PROMPT_TOKENS runs a decode row per query on the native kernel,
    still causal (equal to the prefill reference). With only such rows the step is decode-shaped
    (the model's one-call decode stack); beside a longer prompt the short row gives the same
    bits, so a prompt's result does not depend on what it is batched with."""
    from wsllm.kernels.cpu_attention import SHORT_PROMPT_TOKENS
    from wsllm.kernels.paged_attention import paged_prefill_attention_ref

    bs = 8
    seq_lens, q_lens = (
        [40, 17, 30, fresh],
        [1, 1, 6, fresh],
    )  # two decodes, a chunk ending at 30, a new prompt
    c = make_paged_case(seq_lens, q_lens, bs, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32)
    tables = c.block_tables.tolist()
    # this step's K and V rows as the projection made them (the cache already holds them)
    new = [
        (t[p // bs], p % bs)
        for t, ctx, n in zip(tables, seq_lens, q_lens, strict=True)
        for p in range(ctx - n, ctx)
    ]
    k = torch.stack([c.k_cache[b, o] for b, o in new])
    v = torch.stack([c.v_cache[b, o] for b, o in new])
    plan = plan_cpu_attention(tables, seq_lens, q_lens, bs, torch.float32)
    decode_shaped = not plan.prefills and plan.num_decodes == sum(q_lens)
    assert decode_shaped == (fresh <= SHORT_PROMPT_TOKENS)
    out = cpu_paged_attention(c.q, k, v, c.k_cache, c.v_cache, plan, c.scale)
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(*c.prefill_args()), **tolerance(torch.float32)
    )
    alone = plan_cpu_attention(tables[:3], seq_lens[:3], q_lens[:3], bs, torch.float32)
    assert not alone.prefills, "decodes and a short chunk: decode-shaped"
    rows = sum(q_lens[:3])
    got = cpu_paged_attention(c.q[:rows], k[:rows], v[:rows], c.k_cache, c.v_cache, alone, c.scale)
    assert torch.equal(got, out[:rows]), "the chunk's bits do not depend on the prompt beside it"
