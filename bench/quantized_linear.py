"""8-bit and 4-bit weights on the CPU: torch's own kernels and ours (GGUF blocks), against fp32.

One "step" is one matmul per linear layer of SmolLM2-135M (30 x qkv, o, gate_up, down,
plus the 49,152-row lm_head; 121 distinct weights, so that they stream from memory as the
model's do) at a batch of B rows, as a decode step runs them. Weight
paths, all existing torch kernels (no GEMM of ours):

- fp32 `F.linear` (MKL sgemm), fp32 oneDNN with packed weights (wsllm's CPU default);
- int8 per-channel: `torch._weight_int8pack_mm` (bf16/fp32 activations, int8 weights);
- int4 group-wise (group 32): `torch._weight_int4pack_mm_for_cpu` over weights packed by
  `torch._convert_weight_to_int4pack_for_cpu`;
- ours (kernels/cpu/, `wsllm.kernels.quant.qlinear`) on GGUF Q8_0, Q4_0 and Q4_1 blocks, on
  the best ISA path of the CPU and, with `--all-isas`, on each path it has (avx2, scalar);

`--formats` times our kernels per GGUF format (Q4_0 ... Q6_K) on the linear layers of one
Llama-3-8B layer (q, k, v, o, gate, up, down; two distinct copies so that the weights stream
from memory): milliseconds per layer and the packed weights' GB/s at M = 1 and 8, the
figures that say whether a format's kernel (the K-quants of a Q4_K_M file) is the gap at c=1.

`--layers` times one layer of each shape instead, ours against oneDNN over the de-quantized
weight (fp32, and bf16 packed for bf16 activations) at M in 1..2048, the calls interleaved and
the best of several repeats kept (a shared machine: read the ratios): docs/kernels.md's table.

At large B (prefill: `--batch-sizes 128,512`) the fp32 oneDNN row is the bound of the other
route, dequantizing tiles of the weights and calling a GEMM: that route costs the GEMM plus
the dequantization, so ours only needs to beat the fp32 row (docs/kernels.md).

Prints tokens/s per path and B, the ratio to fp32 oneDNN, and the largest error of a
layer's output against fp32 (relative to the output's scale).

    .venv/bin/python bench/quantized_linear.py [--batch-sizes 1,8,32] [--steps 10] [--all-isas]
    .venv/bin/python bench/quantized_linear.py --batch-sizes 128,512 --steps 2   # prefill
    .venv/bin/python bench/quantized_linear.py --layers [--threads 2]              # one layer, M 1..2048
    .venv/bin/python bench/quantized_linear.py --formats [--threads 2]             # per format, 8B shapes
    .venv/bin/python bench/quantized_linear.py --batch-sizes 1 --prefetch-ahead 0  # the prefetch off (A/B)
    .venv/bin/python bench/quantized_linear.py --formats --prefetch-k 0,0          # the K-quants' off (A/B)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from wsllm.kernels import quant

# (out, in) of each linear layer and how many of it a step runs.
SHAPES = [((960, 576), 30), ((576, 576), 30), ((3072, 576), 30), ((576, 1536), 30), ((49152, 576), 1)]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit, group-wise; -> (packed weight, scales_and_zeros [K/group, N, 2])."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return packed, sz


def our_paths(w: torch.Tensor, isas: list[str]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    n, k = w.shape
    for qtype in ("Q8_0", "Q4_0", "Q4_1"):
        qw = quant.pack(qtype, quant.quantize(w, qtype), (n, k))
        for isa in isas:
            out[f"{qtype} ours ({isa})"] = lambda x, qw=qw, isa=isa: _pinned(isa, x, qw)
    return out


def _pinned(isa: str, x: torch.Tensor, qw: quant.QuantWeight) -> torch.Tensor:
    if quant.kernel_path() != isa:  # pinning costs a few microseconds: only when it changes
        quant.force_isa(isa)
    return quant.qlinear(x, qw)


def paths(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp32 F.linear": lambda x: F.linear(x, w)}
    if torch.backends.mkldnn.is_available():
        p = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        out["fp32 oneDNN packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    q8, s8 = quantize_int8(w)
    out["int8 _weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, q8, s8)
    q4, sz = quantize_int4(w)
    out["int4 _weight_int4pack_mm_for_cpu"] = lambda x: torch._weight_int4pack_mm_for_cpu(x, q4, 32, sz)
    return out


def time_step(
    fns: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int]], steps: int
) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(steps):
            for fn, x, reps in fns:
                for _ in range(reps):
                    fn(x)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def layer_sweep(sizes: list[int], qtype: str) -> None:
    """One layer per shape: ms per call of ours and oneDNN's, fp32 and bf16 activations."""
    g = torch.Generator().manual_seed(0)
    print(
        "| layer | M | x | ours ms | oneDNN fp32 ms | oneDNN (x's dtype) ms | ours / fp32 | ours / oneDNN |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for (n, k), _ in SHAPES[:4]:
        w = torch.randn(n, k, generator=g) * 0.05
        qw = quant.pack(qtype, quant.quantize(w, qtype), (n, k))
        wd = qw.dequantize()
        packed = {
            dt: torch.ops.mkldnn._reorder_linear_weight(wd.to(dt), 32)
            for dt in (torch.float32, torch.bfloat16)
        }
        for m in sizes:
            for dt in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=g).to(dt)
                x32 = x.float()
                p32, pdt = packed[torch.float32], packed[dt]
                fns = {
                    "ours": lambda x=x, qw=qw: quant.qlinear(x, qw),
                    "fp32": lambda x=x32, p=p32: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""
                    ),
                    "same": lambda x=x, p=pdt: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                }
                best = dict.fromkeys(fns, float("inf"))
                reps = max(2, 300 // m)
                for _ in range(5):  # interleaved: a busy moment hits every path alike
                    for name, fn in fns.items():
                        best[name] = min(best[name], _best_call(fn, reps))
                r = best
                print(
                    f"| {n}x{k} | {m} | {str(dt).removeprefix('torch.')} | {r['ours'] * 1e3:.3f} | {r['fp32'] * 1e3:.3f} "
                    f"| {r['same'] * 1e3:.3f} | {r['ours'] / r['fp32']:.2f} | {r['ours'] / r['same']:.2f} |",
                    flush=True,
                )


def _best_call(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all-isas", action="store_true", help="time our kernels on every ISA path the CPU has")
    ap.add_argument("--layers", action="store_true", help="one layer per shape at M in 1..2048 (prefill)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--formats", action="store_true", help="our kernels per GGUF format, Llama-3-8B shapes")
    ap.add_argument(
        "--prefetch-ahead",
        type=int,
        default=None,
        help="bytes the Q4_0/Q4_1/Q8_0 kernels prefetch ahead at batch 1 (0: off; default: the build's 2048)",
    )
    ap.add_argument(
        "--prefetch-k",
        default=None,
        help="K45,Q6K: bytes Q4_K/Q5_K (batch 1) and Q6_K prefetch ahead (0: off; default: the build's 2048,13440)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ok, why = quant.native_status()
    print(why)
    if ok and args.prefetch_ahead is not None:
        from wsllm.kernels import native

        native.extension().set_prefetch_ahead(args.prefetch_ahead)
    if ok and args.prefetch_k is not None:
        from wsllm.kernels import native

        k45, q6k = (int(v) for v in args.prefetch_k.split(","))
        native.extension().set_prefetch_k(k45, q6k)
    if args.formats:
        with torch.inference_mode():
            format_sweep([int(b) for b in args.batch_sizes.split(",")][:2], max(3, args.steps))
        return
    if args.layers:
        with torch.inference_mode():
            sizes = (
                [1, 8, 32, 128, 512, 2048]
                if args.batch_sizes == "1,8,32"
                else [int(b) for b in args.batch_sizes.split(",")]
            )
            layer_sweep(sizes, "Q4_1")
        return
    isas = [quant.kernel_path()] if ok else []
    if ok and args.all_isas:
        isas = [i for i in ("avx512_vnni", "avx2", "scalar") if _can_pin(i)]
    g = torch.Generator().manual_seed(0)
    layers = []
    with torch.inference_mode():
        for (n, k), reps in SHAPES:
            for _ in range(reps):  # distinct weights: one of each would be read from the L3 cache
                w = torch.randn(n, k, generator=g) * 0.05
                layers.append((w, paths(w) | our_paths(w, isas), 1))
        names = list(layers[0][1])
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        tok_s: dict[str, dict[int, float]] = {name: {} for name in names}
        for b in sizes:
            xs = [torch.randn(b, w.shape[1], generator=g) for w, _, _ in layers]
            for name in names:
                fns = [(p[name], x, reps) for (_, p, reps), x in zip(layers, xs, strict=True)]
                for fn, x, _ in fns:
                    fn(x)  # warm-up
                tok_s[name][b] = b / time_step(fns, args.steps)
        base = tok_s.get("fp32 oneDNN packed", tok_s["fp32 F.linear"])
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios against {next(k for k in names if tok_s[k] is base)}"
        )
        print("| weights | " + " | ".join(f"B={b} tok/s" for b in sizes) + " | max rel. error |")
        print("| --- |" + " ---: |" * (len(sizes) + 1))
        x = torch.randn(4, 576, generator=g)
        w, p, _ = next(layer for layer in layers if layer[0].shape == (3072, 576))
        ref = F.linear(x, w)
        for name in names:
            err = ((p[name](x) - ref).abs().max() / ref.abs().max()).item()
            cells = [f"{tok_s[name][b]:,.1f} ({tok_s[name][b] / base[b]:.2f}x)" for b in sizes]
            print(f"| {name} | " + " | ".join(cells) + f" | {err:.1e} |")


# (out, in) of one Llama-3-8B layer's linear layers: q, k, v, o, gate, up, down
LAYER_8B = [
    (4096, 4096),
    (1024, 4096),
    (1024, 4096),
    (4096, 4096),
    (14336, 4096),
    (14336, 4096),
    (4096, 14336),
]
# where each format's fp16 scales sit in a GGUF block (byte offsets): set, the rest random
_SCALE_BYTES = {"Q4_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_weight(qtype: str, n: int, k: int, g: torch.Generator) -> quant.QuantWeight:
    """Random blocks (the kernels' time does not depend on the values) with small finite scales."""
    from wsllm.kernels.quant_formats import BLOCK

    bs, ts = BLOCK[qtype]
    raw = torch.randint(0, 256, (n, k // bs, ts), dtype=torch.uint8, generator=g)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    for off in _SCALE_BYTES[qtype]:
        raw[..., off : off + 2] = scale
    return quant.pack(qtype, raw.reshape(n, -1), (n, k))


def format_sweep(sizes: list[int], reps: int) -> None:
    """Our kernels per format on two copies of one Llama-3-8B layer: ms per layer, GB/s."""
    g = torch.Generator().manual_seed(0)
    print(f"kernel path {quant.kernel_path()}, {torch.get_num_threads()} threads; one Llama-3-8B layer "
          "(q, k, v, o, gate, up, down), two copies read in turn; best of the repeats")  # fmt: skip
    print("| format | MB per layer | " + " | ".join(f"M={m}: ms per layer (GB/s)" for m in sizes) + " |")
    print("| --- | ---: |" + " ---: |" * len(sizes))
    for qtype in quant.QTYPES:
        layers = [[_random_weight(qtype, n, k, g) for n, k in LAYER_8B] for _ in range(2)]
        mb = sum(w.nbytes() for w in layers[0]) / 1e6
        cells = []
        for m in sizes:
            xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in LAYER_8B}}

            def step(
                layers: list[list[quant.QuantWeight]] = layers, xs: dict[int, torch.Tensor] = xs
            ) -> None:
                for layer in layers:
                    for w in layer:
                        quant.qlinear(xs[w.in_features], w)

            step()  # warm-up
            best = min(_timed(step) for _ in range(reps)) / 2  # per layer
            cells.append(f"{best * 1e3:.2f} ({mb / 1e3 / best:.1f})")
        print(f"| {qtype} | {mb:.0f} | " + " | ".join(cells) + " |", flush=True)
        del layers


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _can_pin(isa: str) -> bool:
    try:
        quant.force_isa(isa)
    except RuntimeError:
        return False
    finally:
        quant.force_isa(None)
    return True


if __name__ == "__main__":
    main()
