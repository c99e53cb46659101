"""The grouped expert pass (kernels/cpu/moe.cpp) on every ISA path the CPU has: over random routings
(hypothesis), including an expert no row picks and one every row picks, a row's output is
bit-identical alone, in its batch, and in a batch of other rows with other experts (speculative
decoding relies on it); it equals the torch reference of its arithmetic; the router's choice equals
the torch routing; the whole layer (router, routing, experts, a gated shared expert) equals its
reference; gpt-oss's experts (MXFP4, biases, the clamped SwiGLU, a router bias) alike; the Triton
fused-MoE kernel equals the torch reference in the interpreter, with and without those."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsllm.kernels import moe as kmoe
from wsllm.kernels import native, quant
from wsllm.kernels.quant_formats import BLOCK

E, K = 7, 3  # an odd number of experts, top-3
# (format, hidden, intermediate): a 32-value format of each kind and the K-quants' 256-value blocks
SHAPES = {"Q4_0": (64, 96), "Q8_0": (64, 96), "Q4_1": (64, 32), "Q4_K": (256, 256), "MXFP4": (64, 96)}
# gpt-oss's experts ("MXFP4-oai" layers): biases on gate, up and down, a clamped SwiGLU that clamps
# (a limit within the tiles' values), top-k on the router's logits (with its bias) then a softmax
OAI = kmoe.ExpertAct("swiglu_oai", 1.702, 0.05)
SCALE_OFFSETS = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def isas() -> list[str]:
    ext = native.extension()
    if ext is None:
        return []
    return [isa for i, isa in enumerate(quant.ISAS) if ext.cpu_has(i)]


@pytest.fixture(params=isas() or [None], ids=lambda p: str(p))
def isa(request: pytest.FixtureRequest) -> Any:
    if request.param is None:
        pytest.skip(f"no native build: {native.failure()}")
    quant.force_isa(request.param)
    yield request.param
    quant.force_isa(None)


def packed(qtype: str, n: int, k: int, g: torch.Generator) -> quant.QuantWeight:
    """[n, k] in `qtype`: gguf's quantization of random weights, or (K-quants, which gguf cannot
    make) random bytes with small finite fp16 scales."""
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return quant.pack(qtype, quant.quantize(torch.randn(n, k, generator=g) * 0.1, qtype), (n, k))
    if qtype == "MXFP4":
        from gguf import GGMLQuantizationType, quants

        w = (torch.randn(n, k, generator=g) * 0.1).numpy()
        return quant.pack(qtype, quants.quantize(w, GGMLQuantizationType.MXFP4), (n, k))
    bs, ts = BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // bs, ts), dtype=torch.uint8, generator=g)
    for off in SCALE_OFFSETS[qtype]:
        raw[..., off : off + 2] = (
            ((torch.rand(n, k // bs, 1, generator=g) - 0.5) * 1e-3).half().view(torch.uint8)
        )
    return quant.pack(qtype, raw.reshape(n, -1), (n, k))


_LAYERS: dict[str, tuple[kmoe.QuantExperts, Any, torch.Tensor]] = {}
_BIASES: dict[str, tuple[kmoe.ExpertBias, torch.Tensor]] = {}  # an "-oai" layer's experts' and router's


def layer(kind: str) -> tuple[kmoe.QuantExperts, kmoe.MoeNative, torch.Tensor]:
    """One MoE layer of `kind`'s experts (a format: down in Q8_0 beside the K-quants' gate and up,
    two formats in one pass; "MXFP4-oai": gpt-oss's, its biases in _BIASES), made once."""
    if kind not in _LAYERS:
        g = torch.Generator().manual_seed(len(_LAYERS))
        qtype, oai = kind.removesuffix("-oai"), kind.endswith("-oai")
        h, i = SHAPES[qtype]
        down = "Q6_K" if qtype == "Q4_K" else qtype
        qe = kmoe.QuantExperts(
            E, packed(qtype, E * i, h, g), packed(qtype, E * i, h, g), packed(down, E * h, i, g)
        )
        router = torch.randn(E, h, generator=g)
        if oai:
            bias = kmoe.ExpertBias(torch.randn(E, 2 * i, generator=g) * 0.05, torch.randn(E, h, generator=g))
            rb = torch.randn(E, generator=g)
            _BIASES[kind] = (bias, rb)
            r = kmoe.Routing(K, "softmax_topk")
            nat = kmoe.MoeNative.build(router, None, qe, r, [], None, rb, bias, OAI)
        else:
            nat = kmoe.MoeNative.build(router, None, qe, kmoe.Routing(K), [], None)
        _LAYERS[kind] = (qe, nat, router)
    return _LAYERS[kind]


@st.composite
def routings(draw: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [rows, K] (distinct per row; expert 0 in every row, expert E - 1 in none) and weights."""
    ids = []
    for _ in range(rows):
        others = draw(st.permutations(range(1, E - 1)))[: K - 1]
        ids.append(sorted([0, *others]))
    w = draw(st.lists(st.floats(0.0625, 1.0, width=32), min_size=rows * K, max_size=rows * K))
    return torch.tensor(ids), torch.tensor(w).reshape(rows, K)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "MXFP4-oai"])  # 32/256-value blocks; gpt-oss's experts
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_other_rows_experts(
    isa: str, qtype: str, data: Any
) -> None:
    qe, nat, _ = layer(qtype)
    h = SHAPES[qtype.removesuffix("-oai")][0]
    rows = data.draw(st.integers(1, 9))
    seed = data.draw(st.integers(0, 2**16))
    x = torch.randn(rows, h, generator=torch.Generator().manual_seed(seed))
    ids, w = data.draw(routings(rows))
    got = nat.experts(x, ids, w)
    assert not torch.equal(got[:, :], torch.zeros_like(got))
    for t in range(rows):
        assert torch.equal(got[t], nat.experts(x[t : t + 1], ids[t : t + 1], w[t : t + 1])[0]), t
    # row 0 again, beside other rows of other experts (the last expert now picked too)
    others = torch.randn(5, h, generator=torch.Generator().manual_seed(seed + 1))
    o_ids = (
        torch.tensor([[1, 3, E - 1], [2, 4, 5], [E - 1, 2, 1], [3, 5, E - 1], [1, 2, 3]]).sort(dim=1).values
    )
    batch = torch.cat([others[:2], x[:1], others[2:]])
    b_ids, b_w = (
        torch.cat([o_ids[:2], ids[:1], o_ids[2:]]),
        torch.cat([torch.rand(2, K), w[:1], torch.rand(3, K)]),
    )
    assert torch.equal(nat.experts(batch, b_ids, b_w)[2], got[0])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1", "Q4_K", "MXFP4-oai"])  # Q4_K's: down in Q6_K
def test_the_grouped_pass_equals_the_reference_of_its_arithmetic(isa: str, qtype: str) -> None:
    qe, nat, router = layer(qtype)
    x = torch.randn(5, SHAPES[qtype.removesuffix("-oai")][0], generator=torch.Generator().manual_seed(9))
    ids = torch.tensor([[0, 1, 2], [0, 3, 5], [0, 1, 5], [0, 2, 4], [0, 3, 4]])  # 0 every row's, 6 nobody's
    w = torch.rand(5, K, generator=torch.Generator().manual_seed(10))
    bias, rb = _BIASES.get(qtype, (None, None))
    act = OAI if bias is not None else kmoe.SILU
    got, ref = nat.experts(x, ids, w), kmoe.experts_quant_ref(x, ids, w, qe, bias, act)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
    if bias is not None:  # the router's bias chooses and weighs; the whole layer is its reference's
        r_w, r_ids = kmoe.route(x @ router.T + rb, kmoe.Routing(K, "softmax_topk"))
        n_ids, n_w = nat.route(x)
        assert torch.equal(n_ids.long(), r_ids) and torch.allclose(n_w, r_w, atol=1e-6)
        full, ref = nat.forward(x), kmoe.experts_quant_ref(x, r_ids, r_w, qe, bias, act)
        assert float((full - ref).abs().max() / ref.abs().max()) < 1e-4
        unclamped = kmoe.ExpertAct("swiglu_oai", OAI.alpha, 1e9)
        assert not torch.allclose(
            ref, kmoe.experts_quant_ref(x, r_ids, r_w, qe, bias, unclamped)
        )  # it clamps


def test_the_router_chooses_as_the_torch_routing_and_the_layer_is_batch_invariant(isa: str) -> None:
    _, nat, router = layer("Q4_0")
    x = torch.randn(11, SHAPES["Q4_0"][0], generator=torch.Generator().manual_seed(3))
    ids, w = nat.route(x)
    ref_w, ref_ids = kmoe.route(x @ router.T, kmoe.Routing(K))
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(w, ref_w, atol=1e-6)
    full = nat.forward(x)
    assert torch.equal(full, nat.experts(x, ids, w))
    for t in (0, 5, 10):
        assert torch.equal(full[t], nat.forward(x[t : t + 1])[0])


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "softmax_topk"])
def test_every_routing_knob_and_a_gated_shared_expert_equal_the_reference(isa: str, gating: str) -> None:
    g = torch.Generator().manual_seed(5)
    h, i = SHAPES["Q8_0"]
    qe = kmoe.QuantExperts(
        E, packed("Q8_0", E * i, h, g), packed("Q8_0", E * i, h, g), packed("Q8_0", E * h, i, g)
    )
    router, bias, gate = (
        torch.randn(E, h, generator=g),
        torch.randn(E, generator=g) * 0.1,
        torch.randn(h, generator=g),
    )
    shared = [[packed("Q8_0", 64, h, g)], [packed("Q8_0", h, 32, g)]]
    r = kmoe.Routing(K, gating, renormalize=gating != "softmax_topk", scale=1.5)
    sel = bias if gating != "softmax_topk" else None
    nat = kmoe.MoeNative.build(router, sel, qe, r, shared, gate)
    assert nat is not None
    x = torch.randn(6, h, generator=g)
    w, ids = kmoe.route(x @ router.T, r, sel)
    n_ids, n_w = nat.route(x)
    assert torch.equal(n_ids.long(), ids) and torch.allclose(n_w, w, atol=1e-5)
    gate_up = quant.qlinear_reference(x, shared[0][0])
    s = quant.qlinear_reference(torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:], shared[1][0])
    ref = kmoe.experts_quant_ref(x, ids, w, qe) + torch.sigmoid(x @ gate)[:, None] * s
    got = nat.forward(x)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_the_triton_fused_moe_equals_the_torch_reference_in_the_interpreter() -> None:
    """Rows sorted by expert into blocks, the grouped GEMMs (gate and up with SiLU, down with the
    routing weights): the float experts' reference, with an expert nobody picks and one everybody
    does; its alignment of pairs into blocks of one expert each."""
    from wsllm import kernels

    if not kernels.triton_available():
        pytest.skip("triton is not installed")
    from wsllm.kernels.moe_triton import align, moe_experts_triton

    g = torch.Generator().manual_seed(7)
    t, h, i = 13, 64, 48
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(E, 2 * i, h, generator=g) * 0.1, torch.randn(E, h, i, generator=g) * 0.1
    ids = torch.stack(
        [torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 2, generator=g)[: K - 1]]) for _ in range(t)]
    )
    ids = ids.sort(dim=1).values
    w = torch.rand(t, K, generator=g)
    ref = kmoe.experts_float(x, ids, w, gate_up, down)
    got = moe_experts_triton(x, ids, w, gate_up, down)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    bias = kmoe.ExpertBias(torch.randn(E, 2 * i, generator=g) * 0.1, torch.randn(E, h, generator=g) * 0.1)
    act = kmoe.ExpertAct("swiglu_oai", 1.702, 0.1)  # gpt-oss's experts: biases, a clamp that clamps
    ref = kmoe.experts_float(x, ids, w, gate_up, down, bias, act)
    got = moe_experts_triton(x, ids, w, gate_up, down, bias=bias, act=act)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
    unclamped = kmoe.ExpertAct("swiglu_oai", 1.702, 1e9)
    assert not torch.allclose(ref, kmoe.experts_float(x, ids, w, gate_up, down, bias, unclamped)), "it clamps"
    pairs, experts = align(ids, E, 16)
    real = pairs < t * K
    assert sorted(pairs[real].tolist()) == list(range(t * K))
    blocks = pairs.view(-1, 16)
    for b, e in zip(blocks, experts.tolist(), strict=True):
        assert all(int(ids.view(-1)[p]) == e for p in b.tolist() if p < t * K)
