"""Attention variants (kernels/paged_attention.py: a sliding window, soft-capped scores,
sinks) on the CPU paths against the torch reference, and the reference against HF's own
Gemma 2 and gpt-oss attention. Random paged caches (kernels/testing.py) whose blocks before a
sequence's window are NaN, so a path that reads one fails; chunked prefill and prefix hits
whose queries cross the window, a speculation's multi-token rows (the "mixed" and short
rows), decode, each ISA path of the native kernel, and the torch path (fp16 activations,
which the native kernels do not take); the decode stack's per-layer variants."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from wsllm.kernels import native, quant
from wsllm.kernels.cpu_attention import cpu_paged_attention, plan_cpu_attention
from wsllm.kernels.decode_stack import StackProgram
from wsllm.kernels.paged_attention import (
    attend_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from wsllm.kernels.testing import PREFILL_SCENARIOS, edge_lens, make_paged_case, prefill_batch, tolerance

ext = native.extension()
needs_native = pytest.mark.skipif(ext is None, reason=f"no native build: {native.failure()}")

# window 20 cuts the 300-token contexts and the chunked rows (blocks of 8 and 16); a cap of
# 1.5 bends scores of the size random q and k give; sinks ~ N(0, 4)
VARIANTS = {
    "window": {"window": 20},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window": 20, "softcap": 1.5, "sinks": True},
}


@pytest.fixture(params=["avx512_vnni", "avx2", "scalar"])
def isa(request):
    try:
        quant.force_isa(request.param)
    except RuntimeError as e:
        pytest.skip(str(e))
    yield request.param
    quant.force_isa(None)


def test_the_reference_is_hfs_gemma2_and_gpt_oss_attention() -> None:
    """Soft-cap and window as Gemma 2's eager attention computes them, sinks as gpt-oss's."""
    from transformers.masking_utils import sliding_window_overlay
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    g = torch.Generator().manual_seed(0)
    n, h, hk, d, w = 11, 4, 2, 16, 5
    q, k, v = (
        torch.randn(n, h, d, generator=g),
        torch.randn(n, hk, d, generator=g),
        torch.randn(n, hk, d, generator=g),
    )
    sinks = torch.randn(h, generator=g)
    pos = torch.arange(n)
    seen = torch.tensor(
        [[kv <= qi and sliding_window_overlay(w)(0, 0, qi, kv) for kv in range(n)] for qi in range(n)]
    )
    mask = torch.zeros(n, n).masked_fill_(~seen, -torch.inf)[None, None]
    module = SimpleNamespace(num_key_value_groups=h // hk, training=False, sinks=sinks, head_dim=d)
    hf_args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
    want, _ = gemma2(module, *hf_args, scaling=0.3, softcap=2.0)
    got = attend_ref(q, k, v, pos, pos, 0.3, window=w, softcap=2.0)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)
    want, _ = gpt_oss(module, *hf_args, scaling=0.3)
    got = attend_ref(q, k, v, pos, pos, 0.3, window=w, sinks=sinks)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)


def test_each_variant_changes_the_answer_and_reduces_to_plain_attention_at_its_limit() -> None:
    """So that the tests below can fail: each variant moves the output; and a window past
    every context, a cap far above every score, sinks far below, give plain attention."""
    lens, q_lens = prefill_batch("chunked", 8)
    plain = make_paged_case(lens, q_lens, 8, 2, 3, 64, torch.float32)
    want = paged_prefill_attention_ref(*plain.prefill_args())
    for name, kw in VARIANTS.items():
        c = make_paged_case(lens, q_lens, 8, 2, 3, 64, torch.float32, **kw)
        moved = paged_prefill_attention_ref(*c.prefill_args(), **c.variant())
        assert not torch.isnan(moved).any()
        assert (moved - want).abs().max() > 0.05, name
    limits = {"window": 10**6, "softcap": 1e6, "sinks": torch.full((6,), -1e4)}
    for name, value in limits.items():
        got = paged_prefill_attention_ref(*plain.prefill_args(), **{name: value})
        torch.testing.assert_close(got, want, **tolerance(torch.float32))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (8, 128), (3, 24)])  # 24: not the vectors
def test_native_decode_attention_equals_the_reference(
    isa: str, variant: str, dtype: torch.dtype, group: int, head_dim: int
) -> None:
    c = make_paged_case(edge_lens(16), None, 16, 2, group, head_dim, dtype, **VARIANTS[variant])
    assert ext is not None
    got = ext.decode_attention(
        c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.scale, quant.isa_index(), **c.variant()
    )
    want = paged_decode_attention_ref(*c.decode_args(), **c.variant())
    torch.testing.assert_close(got.view_as(want), want, **tolerance(dtype))


@needs_native
def test_native_decode_reads_and_checks_only_the_blocks_its_window_sees(isa: str) -> None:
    """Blocks before the window may be anyone's (-1 here: not even checked); a window as long
    as the context is plain attention, bit for bit (the same path)."""
    assert ext is not None
    c = make_paged_case([300, 45], None, 16, 2, 3, 64, torch.float32, window=20, sinks=True)
    tables = c.block_tables.clone()
    tables[0, :17], tables[1, :1] = -1, -1  # 300: positions 280.. from block 17; 45: 25.. from block 1
    args = (c.q, c.k_cache, c.v_cache, tables, c.seq_lens, c.scale, quant.isa_index())
    got = ext.decode_attention(*args, **c.variant())
    want = paged_decode_attention_ref(*c.decode_args(), **c.variant())
    torch.testing.assert_close(got.view_as(want), want, **tolerance(torch.float32))
    plain = make_paged_case(edge_lens(16), None, 16, 2, 3, 64, torch.float32)
    base = (
        plain.q,
        plain.k_cache,
        plain.v_cache,
        plain.block_tables,
        plain.seq_lens,
        plain.scale,
        quant.isa_index(),
    )
    assert torch.equal(ext.decode_attention(*base, window=300), ext.decode_attention(*base))
    with pytest.raises(RuntimeError, match="sinks"):
        ext.decode_attention(*base, sinks=torch.zeros(5))


def _new_kv(
    cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int], q_lens: list[int]
) -> torch.Tensor:
    """The K (or V) rows of each sequence's last q_len positions, as the projection made them."""
    bs = cache.shape[1]
    rows = [
        cache[t[p // bs], p % bs]
        for t, ctx, n in zip(tables, seq_lens, q_lens, strict=True)
        for p in range(ctx - n, ctx)
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", PREFILL_SCENARIOS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16-torch"]
)
def test_cpu_attention_equals_the_reference_across_the_window(
    scenario: str, variant: str, dtype: torch.dtype
) -> None:
    """The plan shared by a step's layers, run with one layer's variant: decodes, short rows
    and speculation's multi-token rows on the native kernel, chunks and prefix hits that
    cross the window (SDPA from the window's first block, or a decode row per query for a
    cap or sinks), fresh prompts longer than the window."""
    bs = 8
    seq_lens, q_lens = prefill_batch(scenario, bs)
    if scenario == "prefill":  # a fresh prompt past SHORT_PROMPT_TOKENS and the window
        seq_lens, q_lens = seq_lens + [40], q_lens + [40]
    c = make_paged_case(seq_lens, q_lens, bs, 2, 3, 64, dtype, **VARIANTS[variant])
    tables = c.block_tables.tolist()
    k, v = _new_kv(c.k_cache, tables, seq_lens, q_lens), _new_kv(c.v_cache, tables, seq_lens, q_lens)
    plan = plan_cpu_attention(tables, seq_lens, q_lens, bs, dtype)
    got = cpu_paged_attention(c.q, k, v, c.k_cache, c.v_cache, plan, c.scale, **c.variant())
    want = paged_prefill_attention_ref(*c.prefill_args(), **c.variant())
    torch.testing.assert_close(got, want, **tolerance(dtype))
    # the same plan serves a layer without the variant (Gemma's full layers beside windowed ones)
    plain = paged_prefill_attention_ref(*c.prefill_args())
    if "window" in VARIANTS[variant]:  # the poisoned blocks lie before the window: a full layer reads them
        return
    torch.testing.assert_close(
        cpu_paged_attention(c.q, k, v, c.k_cache, c.v_cache, plan, c.scale), plain, **tolerance(dtype)
    )


def _rope_tables(d: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's cos and sin rows (cpu_attention_plan.py) for positions pos."""
    from wsllm.kernels.rotary import compute_cos_sin_cache

    cs = compute_cos_sin_cache(d, 10000.0, 64, None).index_select(0, pos)
    half = d // 2
    return torch.cat([cs[:, :half], cs[:, :half]], 1)[:, None], torch.cat([-cs[:, half:], cs[:, half:]], 1)[
        :, None
    ]


class _Proj:
    """A quantized projection as StackProgram.linear reads one (QuantLinear's native_parts)."""

    def __init__(self, w: quant.QuantWeight) -> None:
        self.w = w

    def native_parts(self) -> tuple[list[quant.QuantWeight], None]:
        return [self.w], None


@needs_native
def test_the_decode_stack_runs_each_layers_own_variant() -> None:
    """The decode stack's attention op with a variant: layer 0 windowed, layer 1 soft-capped with sinks and its own
    scale; the stack's output is the chain of the same kernels called one by one, bit for bit,
    and not what a stack without the variants gives."""
    assert ext is not None
    g = torch.Generator().manual_seed(3)
    hidden, h, hk, d, inter, bs, eps = 64, 4, 2, 16, 96, 8, 1e-5
    lens = [30, 9]
    c = make_paged_case(lens, None, bs, hk, h // hk, d, torch.float32)
    q8 = quant.QTYPES.index("Q8_0")
    shapes = [((h + 2 * hk) * d, hidden), (hidden, h * d), (2 * inter, hidden), (hidden, inter)] * 2
    ws = [quant.pack("Q8_0", quant.quantize(torch.randn(*s, generator=g) * 0.1, "Q8_0"), s) for s in shapes]
    norms = [torch.rand(hidden, generator=g) + 0.5 for _ in range(4)]
    sinks = torch.randn(h, generator=g)
    variants = [
        {"window": 12, "softcap": 0.0, "sinks": None, "scale": d**-0.5},
        {"window": 0, "softcap": 1.5, "sinks": sinks, "scale": 0.7 * d**-0.5},
    ]
    pos = c.seq_lens.long() - 1
    tables = c.block_tables
    slots = tables.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    cos, sin = _rope_tables(d, pos)
    x = torch.randn(2, hidden, generator=g)
    isa = quant.isa_index()

    def stack(with_variants: bool) -> list[torch.Tensor]:
        caches = [c.k_cache.clone(), c.v_cache.clone(), c.k_cache.clone(), c.v_cache.clone()]
        prog = StackProgram(torch.float32)
        for layer in range(2):
            v = (
                variants[layer]
                if with_variants
                else {"window": 0, "softcap": 0.0, "sinks": None, "scale": d**-0.5}
            )
            prog.norm(norms[2 * layer], eps)
            prog.linear(_Proj(ws[4 * layer]))
            prog.attention(
                caches[2 * layer], caches[2 * layer + 1], h, v["scale"], v["window"], v["softcap"], v["sinks"]
            )
            prog.linear(_Proj(ws[4 * layer + 1]))
            prog.norm(norms[2 * layer + 1], eps)
            prog.linear(_Proj(ws[4 * layer + 2]))
            prog.silu_mul()
            prog.linear(_Proj(ws[4 * layer + 3]))
        return prog.build().forward(x, cos, sin, slots, tables, c.seq_lens, isa)

    def linear(y: torch.Tensor, i: int) -> torch.Tensor:
        return ext.qlinear(y, ws[i].packed, q8, ws[i].out_features, None, isa, False)

    y, res = ext.add_rms_norm(x, None, norms[0], eps, isa)[0], x  # the chain the program runs, op by op
    for layer, v in enumerate(variants):
        if layer:
            y, res = ext.add_rms_norm(y, res, norms[2 * layer], eps, isa)
        kc, vc = c.k_cache.clone(), c.v_cache.clone()
        kw = {k: v[k] for k in ("window", "softcap", "sinks")}
        o = ext.rope_store_decode(
            linear(y, 4 * layer), cos, sin, kc, vc, slots, h, tables, c.seq_lens, v["scale"], isa, **kw
        )
        y, res = ext.add_rms_norm(linear(o, 4 * layer + 1), res, norms[2 * layer + 1], eps, isa)
        y = linear(ext.silu_mul(linear(y, 4 * layer + 2), isa), 4 * layer + 3)
    got, got_res = stack(True)
    assert torch.equal(got, y) and torch.equal(got_res, res)
    assert not torch.equal(stack(False)[0], got)
