"""Quantized linear layers on GGUF blocks: the API the model loader uses.

    w = pack("Q4_1", raw_bytes, (N, K))     # once, at load: GGUF bytes -> the kernels' layout
    y = qlinear(x, w, bias)                 # x: [M, K] float32 / bfloat16 -> [M, N]

`qlinear` runs the C++ kernels of kernels/cpu/ (built on first use, see kernels/native.py)
with run-time dispatch among AVX-512 VNNI, AVX2 and scalar code, and falls back to the
torch reference (`qlinear_reference`, same arithmetic, same bits) when no build exists.
The arithmetic is written down in kernels/quant_ref.py and docs/kernels.md.
"""

from __future__ import annotations

import gguf
import torch

from . import native
from .quant_formats import BLOCK, QTYPES, block_parts, check_shape, dequantize_fields, pack_raw, packed_fields
from .quant_formats import raw_fields as _raw_fields
from .quant_ref import qlinear_parts, quantize_blocks

__all__ = [
    "QTYPES",
    "QuantWeight",
    "dequantize_raw",
    "force_isa",
    "kernel_path",
    "native_status",
    "pack",
    "qlinear",
    "qlinear_reference",
    "quantize",
]

ISAS = ("avx512_vnni", "avx2", "scalar")
_QTYPE_ID = {name: i for i, name in enumerate(QTYPES)}  # the C++ side's numbering
_forced: str | None = None


class QuantWeight:
    """One [N, K] weight in the kernels' layout (kernels/quant_formats.py); immutable after pack."""

    __slots__ = ("qtype", "out_features", "in_features", "packed")

    def __init__(self, qtype: str, shape: tuple[int, int], packed: torch.Tensor) -> None:
        n, k = check_shape(qtype, shape)
        nb = k // BLOCK[qtype][0]
        groups = -(-n // 8)
        if packed.dtype is not torch.uint8 or packed.dim() != 3 or tuple(packed.shape[:2]) != (groups, nb):
            raise ValueError(
                f"packed {qtype} [{n}, {k}] must be uint8 [{groups}, {nb}, *], got {packed.shape}"
            )
        self.qtype = qtype
        self.out_features = n
        self.in_features = k
        self.packed = packed.contiguous()  # uint8 [groups, blocks, bytes]

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype}, [{self.out_features}, {self.in_features}])"

    def nbytes(self) -> int:
        return self.packed.numel()

    def dequantize(self) -> torch.Tensor:
        """-> float32 [N, K], equal to gguf.quants.dequantize of the GGUF bytes."""
        f = packed_fields(self.qtype, self.packed)
        return dequantize_fields(self.qtype, f)[: self.out_features]

    def select_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows int [R] -> float32 [R, K]; unpacks only the groups it needs."""
        rows = rows.reshape(-1).long()
        groups, inverse = torch.unique(rows // 8, return_inverse=True)
        f = packed_fields(self.qtype, self.packed[groups])
        deq = dequantize_fields(self.qtype, f)  # [len(groups) * 8, K]
        return deq[inverse * 8 + rows % 8]

    def state(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed}

    @classmethod
    def from_state(cls, qtype: str, shape: tuple[int, int], state: dict[str, torch.Tensor]) -> QuantWeight:
        return cls(qtype, shape, state["packed"])


def pack(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> QuantWeight:
    """raw: uint8, the GGUF bytes of N rows of K values -> the kernels' layout."""
    n, k = check_shape(qtype, shape)
    return QuantWeight(qtype, (n, k), pack_raw(qtype, torch.as_tensor(raw), n, k))


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [N, K] -> GGUF bytes uint8 [N, K / 32 * type_size], equal to gguf.quants.quantize
    (Q8_0, Q4_0 and Q4_1; the K-quants need llama.cpp's search, which gguf does not have)."""
    n, k = check_shape(qtype, tuple(w.shape))  # type: ignore[arg-type]
    bs, ts = BLOCK[qtype]
    blocks = w.detach().float().reshape(-1, bs)
    return quantize_blocks(qtype, blocks).reshape(n, k // bs * ts)


def dequantize_raw(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF bytes -> float32 [N, K], bit-equal to gguf.quants.dequantize."""
    n, k = check_shape(qtype, shape)
    bs, ts = BLOCK[qtype]
    blocks = torch.as_tensor(raw).reshape(-1).view(torch.uint8).reshape(n, k // bs, ts)
    return dequantize_fields(qtype, _raw_fields(qtype, blocks))


def qlinear_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, the kernels' arithmetic (kernels/quant_ref.py): [M, K] -> [M, N] in x's dtype."""
    f = packed_fields(w.qtype, w.packed)
    parts = block_parts(w.qtype, {name: t[: w.out_features] for name, t in f.items()})
    return qlinear_parts(w.qtype, x, parts, bias)


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] float32 or bfloat16 -> [M, N] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"qlinear of {w} needs x [M, {w.in_features}], got {tuple(x.shape)}")
    ext = native.extension()
    if ext is None:
        return qlinear_reference(x, w, bias)
    xf = x.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = ext.qlinear(xf, w.packed, _QTYPE_ID[w.qtype], w.out_features, b, ISAS.index(kernel_path()))
    return out if x.dtype is torch.float32 else out.to(x.dtype)


def native_status() -> tuple[bool, str]:
    """(built and loaded?, the reason it is not, or the kernel path it takes)."""
    ext = native.extension()
    if ext is None:
        return False, native.failure() or "not built"
    return True, f"native kernels, {kernel_path()} path"


def _cpu_has(isa: str) -> bool:
    ext = native.extension()
    return ext is not None and bool(ext.cpu_has(ISAS.index(isa)))


def kernel_path() -> str:
    """ "avx512_vnni", "avx2" or "scalar": what qlinear runs; "torch" without a native build."""
    if native.extension() is None:
        return "torch"
    if _forced is not None:
        return _forced
    return next(isa for isa in ISAS if _cpu_has(isa))


def force_isa(name: str | None) -> None:
    """Pin one path ("avx512_vnni", "avx2", "scalar"), for tests; None: the best the CPU has."""
    global _forced
    if name is not None:
        if name not in ISAS:
            raise ValueError(f"unknown ISA {name!r}; one of {', '.join(ISAS)}")
        if not _cpu_has(name):
            raise RuntimeError(f"this CPU (or build) cannot run the {name} path")
    _forced = name


def gguf_qtype(qtype: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qtype]
