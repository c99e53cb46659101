"""The quantized CPU kernels (kernels/cpu/) against their torch reference, and the GGUF formats
against the gguf package: dequantization bit for bit, quantization byte for byte; unforced,
the kernels take the best path this CPU has (as /proc/cpuinfo tells it, not the build)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from wsllm.kernels import quant
from wsllm.kernels.quant_formats import BLOCK

GGUF_CAN_QUANTIZE = ("Q4_0", "Q4_1", "Q8_0")  # quant.quantize's formats, byte for byte gguf's
GGUF_QUANTIZES = (*GGUF_CAN_QUANTIZE, "MXFP4")  # the formats whose test bytes gguf quantizes
# where each format keeps its fp16 scales in a GGUF block
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def gguf_bytes(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes of an [n, k] tensor: gguf's own quantization where it has one, else random
    bytes with finite fp16 scales (every bit pattern of the other fields is valid). MXFP4's
    first blocks get the exponents of its subnormal scales (0, 1) and its first normal one (2)."""
    g = torch.Generator().manual_seed(seed)
    if qtype in GGUF_QUANTIZES:
        w = torch.randn(n, k, generator=g) * 0.05
        raw = torch.from_numpy(quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype]))
        if qtype == "MXFP4":
            raw.view(n, k // 32, 17)[:3, 0, 0] = torch.tensor([0, 1, 2], dtype=torch.uint8)
        return raw
    bs, ts = BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // bs, ts), dtype=torch.uint8, generator=g)
    for off in SCALE_OFFSETS[qtype]:
        scale = (torch.rand(n, k // bs, 1, generator=g) - 0.5) * 0.02
        raw[..., off : off + 2] = scale.half().view(torch.uint8)
    return raw.reshape(n, -1)


def shape_for(qtype: str) -> tuple[int, int]:
    # N = 37: two full groups of 16 rows and a tail of 5; K: three blocks or two super-blocks
    return (37, 96) if BLOCK[qtype][0] == 32 else (37, 512)


def available_isas() -> list[str]:
    ok, _ = quant.native_status()
    if not ok:
        return []
    out = []
    for isa in ("avx512_vnni", "avx2", "scalar"):
        try:
            quant.force_isa(isa)
            out.append(isa)
        except RuntimeError:
            pass
    quant.force_isa(None)
    return out


@pytest.fixture
def isa_path(request):
    isa = request.param
    if isa not in available_isas():
        pytest.skip(f"the {isa} path cannot run here ({quant.native_status()[1]})")
    quant.force_isa(isa)
    yield isa
    quant.force_isa(None)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("isa_path", ["avx512_vnni", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_qlinear_equals_reference(qtype: str, isa_path: str) -> None:
    n, k = shape_for(qtype)
    w = quant.pack(qtype, gguf_bytes(qtype, n, k), (n, k))
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    assert quant.kernel_path() == isa_path
    for m in (1, 3, 8, 32, 33):
        x = torch.randn(m, k, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            for b in (None, bias):
                y = quant.qlinear(x.to(dtype), w, b)
                ref = quant.qlinear_reference(x.to(dtype), w, b)
                assert y.shape == (m, n) and y.dtype == dtype
                assert rel_err(y, ref) <= 1e-5, (qtype, isa_path, m, dtype)


@pytest.mark.parametrize("isa_path", ["avx512_vnni", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_each_row_has_the_same_bits_whatever_the_batch(qtype: str, isa_path: str) -> None:
    """A row of x gives the same bits alone and in batches of any size (the tiles of 4, 3, 2
    and 1 rows, and the threads, compute every row alike); MXFP4 the reference's bits too."""
    n, k = shape_for(qtype)
    w = quant.pack(qtype, gguf_bytes(qtype, n, k, seed=5), (n, k))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        whole = quant.qlinear(xs, w)
        for lo, hi in ((0, 1), (3, 5), (4, 11), (0, 7)):
            assert torch.equal(quant.qlinear(xs[lo:hi], w), whole[lo:hi]), (qtype, isa_path, dtype, lo, hi)
        if qtype == "MXFP4":
            assert torch.equal(whole, quant.qlinear_reference(xs, w))


# each path and the CPU flags it needs (Linux's names in /proc/cpuinfo)
NEEDS = {
    "avx512_vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="the CPU's flags are read from /proc/cpuinfo")
def test_unforced_the_kernels_take_the_best_path_the_cpu_has() -> None:
    """A detection bug that fell back to the scalar path (50x slower) passed every other
    test: they compare answers, and every path answers the same."""
    if not quant.native_status()[0]:
        pytest.skip("no native build: the torch path runs (see `make install`)")
    with open("/proc/cpuinfo") as f:
        line = next(x for x in f if x.startswith("flags"))
    flags = set(line.split(":", 1)[1].split())
    can = [isa for isa in quant.ISAS if NEEDS[isa] <= flags]
    assert [isa for isa in quant.ISAS if quant._cpu_has(isa)] == can
    quant.force_isa(None)
    assert quant.kernel_path() == can[0] and quant.ISAS[quant.isa_index()] == can[0]


def test_other_dtypes_and_strided_x() -> None:
    # fp16 goes through float32; a strided view (a slice of a fused output) is made contiguous
    n, k = shape_for("Q4_1")
    w = quant.pack("Q4_1", gguf_bytes("Q4_1", n, k), (n, k))
    x = torch.randn(5, 2 * k, generator=torch.Generator().manual_seed(4))[:, ::2]
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        y = quant.qlinear(x.to(dtype), w, torch.ones(n, dtype=dtype))
        assert y.dtype == dtype
        assert torch.equal(y, quant.qlinear_reference(x.to(dtype), w, torch.ones(n, dtype=dtype)))


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_reference_is_close_to_float_matmul(qtype: str) -> None:
    # int8 activations cost well under 1% against the dequantized weights in fp32
    n, k = shape_for(qtype)
    w = quant.pack(qtype, gguf_bytes(qtype, n, k), (n, k))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
    assert rel_err(quant.qlinear_reference(x, w), x @ w.dequantize().t()) < 2e-2


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype: str) -> None:
    n, k = shape_for(qtype)
    raw = gguf_bytes(qtype, n, k)
    expected = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(quant.dequantize_raw(qtype, raw, (n, k)).numpy(), expected)
    w = quant.pack(qtype, raw, (n, k))
    assert (w.qtype, w.out_features, w.in_features) == (qtype, n, k)
    read_only = raw.numpy().copy()  # as GGUFReader maps a file
    read_only.setflags(write=False)
    assert torch.equal(quant.pack(qtype, read_only, (n, k)).packed, w.packed)
    assert np.array_equal(w.dequantize().numpy(), expected)  # native when built
    assert np.array_equal(w.dequantize_torch().numpy(), expected)


def test_mxfp4_every_exponent_and_nibble_dequantizes_as_gguf() -> None:
    """All 256 E8M0 exponents (the subnormal scales below 2, infinities from 2 ** 125 * 12 on)
    times all 16 E2M1 values, on the native and the torch path."""
    raw = torch.zeros(16, 16, 17, dtype=torch.uint8)  # 16 rows of 16 blocks: one per exponent
    raw[..., 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)
    raw[..., 1:] = torch.arange(16, dtype=torch.uint8) | (torch.arange(15, -1, -1, dtype=torch.uint8) << 4)
    expected = quants.dequantize(raw.reshape(16, -1).numpy(), gguf.GGMLQuantizationType.MXFP4)
    w = quant.pack("MXFP4", raw, (16, 512))
    assert np.array_equal(w.dequantize().numpy(), expected)
    assert np.array_equal(w.dequantize_torch().numpy(), expected)


@pytest.mark.parametrize("qtype", GGUF_CAN_QUANTIZE)
def test_quantize_equals_gguf(qtype: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    w[0, :32] = 0.0  # an all-zero block: scale 0
    w[1, :32] = 1.0  # max == min for Q4_1
    ours = quant.quantize(w, qtype)
    assert ours.dtype == torch.uint8
    assert np.array_equal(ours.numpy(), quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype]))


def test_state_round_trip_and_select_rows() -> None:
    n, k = 21, 512
    w = quant.pack("Q6_K", gguf_bytes("Q6_K", n, k), (n, k))
    again = quant.QuantWeight.from_state("Q6_K", (n, k), {name: t.clone() for name, t in w.state().items()})
    assert torch.equal(again.dequantize(), w.dequantize())
    rows = torch.tensor([20, 0, 7, 8, 20])
    assert torch.equal(again.select_rows(rows), w.dequantize()[rows])
    assert torch.equal(again.select_rows_torch(rows), w.dequantize()[rows])
    for bad in (21, 31, -1):  # 21..31 exist as the last group's padding, but are no rows
        with pytest.raises(IndexError):
            w.select_rows(torch.tensor([bad]))
        with pytest.raises(IndexError):
            w.select_rows_torch(torch.tensor([bad]))
    with pytest.raises(ValueError):
        quant.QuantWeight.from_state("Q6_K", (n + 16, k), w.state())
    with pytest.raises(ValueError, match="layout"):  # a cache written by another layout
        quant.QuantWeight.from_state("Q6_K", (n, k), {"packed": w.state()["packed"]})


def test_memory_is_ggufs() -> None:
    # the packed layout keeps GGUF's bytes per weight (K-quants' unpacked 6-bit scales: +2.8%)
    for qtype in quant.QTYPES:
        n, k = 64, 512
        raw = gguf_bytes(qtype, n, k)
        packed = quant.pack(qtype, raw, (n, k)).state()["packed"]
        assert packed.numel() <= raw.numel() * 1.03, qtype


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core")
def test_the_kernels_run_on_torchs_threads() -> None:
    # at::parallel_for is OpenMP inlined from torch's headers: a build without -fopenmp
    # runs every call on one core whatever torch's setting (prefill 3-4x slower)
    from wsllm.kernels import native

    ext = native.extension()
    if ext is None:
        pytest.skip(f"no native build: {native.failure()}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ext.parallel_threads() == 2
        torch.set_num_threads(1)
        assert ext.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.pack("Q4_K", torch.zeros(144, dtype=torch.uint8), (1, 128))
    with pytest.raises(ValueError, match="bytes"):
        quant.pack("Q8_0", torch.zeros(33, dtype=torch.uint8), (1, 32))
    w = quant.pack("Q8_0", torch.zeros(34, dtype=torch.uint8), (1, 32))
    with pytest.raises(ValueError, match="x"):
        quant.qlinear(torch.zeros(2, 64), w)


_NO_COMPILER = """
import json, torch
from wsllm.kernels import quant
w = quant.pack("Q8_0", quant.quantize(torch.randn(10, 64), "Q8_0"), (10, 64))
x = torch.randn(3, 64)
ok, why = quant.native_status()
y = quant.qlinear(x, w)
print(json.dumps({"ok": ok, "why": why, "path": quant.kernel_path(),
                  "same": bool(torch.equal(y, quant.qlinear_reference(x, w)))}))
"""


def test_without_a_compiler_the_torch_path_answers(tmp_path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(empty), WSLLM_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and "compiler" in result["why"] and "g++" in result["why"]
    assert result["path"] == "torch" and result["same"]
    assert proc.stderr.count("quantized CPU kernels unavailable") == 1  # logged once


def test_a_built_extension_loads_without_the_compiler(tmp_path) -> None:
    # `make install` (or the image) builds once; the server then needs no compiler
    from wsllm.kernels import native

    if not quant.native_status()[0]:
        pytest.skip(quant.native_status()[1])
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(empty), WSLLM_KERNELS_DIR=str(native.cache_root()))
    proc = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["path"] != "torch" and result["same"]
