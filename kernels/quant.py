"""Quantized linear layers on GGUF blocks: the API the model loader uses.

    w = pack("Q4_1", raw_bytes, (N, K))     # once, at load: GGUF bytes -> the kernels' layout
    y = qlinear(x, w, bias)                 # x: [M, K] float32 / bfloat16 -> [M, N]

`qlinear` runs the C++ kernels of kernels/cpu/ (built on first use, see kernels/native.py)
with run-time dispatch among AVX-512 VNNI, AVX2 and scalar code, and falls back to the
torch reference (`qlinear_reference`, same arithmetic, same bits) when no build exists.
The arithmetic is written down in kernels/quant_ref.py and docs/kernels.md.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from . import native
from .quant_formats import (
    BLOCK,
    QTYPES,
    ROWS,
    block_parts,
    check_shape,
    dequantize_fields,
    pack_raw,
    packed_block_bytes,
    packed_fields,
)
from .quant_formats import raw_fields as _raw_fields
from .quant_ref import qlinear_parts, quantize_blocks

__all__ = [
    "QTYPES",
    "QuantWeight",
    "dequantize_raw",
    "force_isa",
    "isa_index",
    "kernel_path",
    "native_status",
    "pack",
    "qlinear",
    "qlinear_reference",
    "quantize",
]

ISAS = ("avx512_vnni", "avx2", "scalar")
LAYOUT_VERSION = 1  # bump when quant_formats' packed layout changes: cached states then refuse to load
_QTYPE_ID = {name: i for i, name in enumerate(QTYPES)}  # the C++ side's numbering
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_forced: str | None = None  # force_isa's pin
_chosen: int | None = None  # the ISA qlinear runs, once known (index into ISAS)


class QuantWeight:
    """One [N, K] weight in the kernels' layout (kernels/quant_formats.py); immutable after pack."""

    __slots__ = ("qtype", "out_features", "in_features", "packed")

    def __init__(self, qtype: str, shape: tuple[int, int], packed: torch.Tensor) -> None:
        n, k = check_shape(qtype, shape)
        nb = k // BLOCK[qtype][0]
        groups = -(-n // ROWS)
        want = (groups, nb, packed_block_bytes(qtype))
        if packed.dtype is not torch.uint8 or tuple(packed.shape) != want:
            raise ValueError(
                f"packed {qtype} [{n}, {k}] must be uint8 {list(want)}, got {list(packed.shape)}"
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
        ext = native.extension()
        if ext is not None:
            rows = torch.arange(self.out_features)
            return ext.dequant_rows(self.packed, _QTYPE_ID[self.qtype], self.out_features, rows)
        return self.dequantize_torch()

    def dequantize_torch(self) -> torch.Tensor:
        """dequantize() in plain torch (no native build)."""
        return dequantize_fields(self.qtype, packed_fields(self.qtype, self.packed))[: self.out_features]

    def select_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows int [R] -> float32 [R, K], the rows of dequantize()."""
        rows = rows.reshape(-1).long().contiguous()
        ext = native.extension()
        if ext is not None:
            return ext.dequant_rows(self.packed, _QTYPE_ID[self.qtype], self.out_features, rows)
        return self.select_rows_torch(rows)

    def select_rows_torch(self, rows: torch.Tensor) -> torch.Tensor:
        """select_rows() in plain torch: unpacks only the groups of rows it needs."""
        rows = rows.reshape(-1).long()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.out_features):
            raise IndexError(f"row index out of range for {self}")
        groups, inverse = torch.unique(rows // ROWS, return_inverse=True)
        f = packed_fields(self.qtype, self.packed[groups])
        deq = dequantize_fields(self.qtype, f)  # [len(groups) * 8, K]
        return deq[inverse * ROWS + rows % ROWS]

    def state(self) -> dict[str, torch.Tensor]:
        """For caching (safetensors): the packed bytes and the layout's version."""
        return {"packed": self.packed, "layout": torch.tensor([LAYOUT_VERSION, ROWS], dtype=torch.int32)}

    @classmethod
    def from_state(cls, qtype: str, shape: tuple[int, int], state: dict[str, torch.Tensor]) -> QuantWeight:
        """ValueError when the state was packed by another layout (the caller packs again)."""
        layout = state.get("layout")
        if layout is None or layout.tolist() != [LAYOUT_VERSION, ROWS]:
            got = None if layout is None else layout.tolist()
            raise ValueError(
                f"cached {qtype} weight has layout {got}, this code packs {[LAYOUT_VERSION, ROWS]}"
            )
        return cls(qtype, shape, state["packed"])


def _bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    """GGUF bytes as a flat uint8 tensor; a read-only numpy array (GGUFReader's memory map) is
    read, never written, so torch's warning about it does not apply."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    return raw.reshape(-1).view(torch.uint8)


def pack(qtype: str, raw: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """raw: uint8, the GGUF bytes of N rows of K values (a tensor or GGUFReader's numpy array)
    -> the kernels' layout."""
    n, k = check_shape(qtype, shape)
    return QuantWeight(qtype, (n, k), pack_raw(qtype, _bytes(raw), n, k))


def quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [N, K] -> GGUF bytes uint8 [N, K / 32 * type_size], equal to gguf.quants.quantize
    (Q8_0, Q4_0 and Q4_1; the K-quants need llama.cpp's search, which gguf does not have)."""
    n, k = check_shape(qtype, tuple(w.shape))  # type: ignore[arg-type]
    bs, ts = BLOCK[qtype]
    blocks = w.detach().float().reshape(-1, bs)
    return quantize_blocks(qtype, blocks).reshape(n, k // bs * ts)


def dequantize_raw(qtype: str, raw: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF bytes -> float32 [N, K], bit-equal to gguf.quants.dequantize."""
    n, k = check_shape(qtype, shape)
    bs, ts = BLOCK[qtype]
    blocks = _bytes(raw).reshape(n, k // bs, ts)
    return dequantize_fields(qtype, _raw_fields(qtype, blocks))


def qlinear_reference(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Plain torch, the kernels' arithmetic (kernels/quant_ref.py): [M, K] -> [M, N] in out_dtype
    (default x's)."""
    f = packed_fields(w.qtype, w.packed)
    parts = block_parts(w.qtype, {name: t[: w.out_features] for name, t in f.items()})
    return qlinear_parts(w.qtype, x, parts, bias, out_dtype)


def qlinear(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x: [M, K] float32 or bfloat16 -> [M, N] in out_dtype (default: x's). A float32 result of
    bfloat16 x comes from the kernel's float sums as they are (the logits: no rounding to bf16)."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"qlinear of {w} needs x [M, {w.in_features}], got {tuple(x.shape)}")
    ext = native.extension()
    if ext is None:
        return qlinear_reference(x, w, bias, out_dtype)
    # float32 and bfloat16 go in and come out as they are (no conversion ops around the call)
    native_dtype = x.dtype in _NATIVE_DTYPES
    xin = x.contiguous() if native_dtype else x.float().contiguous()
    isa = _chosen if _chosen is not None else _isa_id(ext)
    out = ext.qlinear(
        xin, w.packed, _QTYPE_ID[w.qtype], w.out_features, bias, isa, out_dtype is torch.float32
    )
    want = out_dtype or x.dtype
    return out if out.dtype is want else out.to(want)


def native_status() -> tuple[bool, str]:
    """(built and loaded?, the reason it is not, or the kernel path it takes)."""
    ext = native.extension()
    if ext is None:
        return False, native.failure() or "not built"
    return True, f"native kernels, {kernel_path()} path"


def _cpu_has(isa: str) -> bool:
    ext = native.extension()
    return ext is not None and bool(ext.cpu_has(ISAS.index(isa)))


def _isa_id(ext) -> int:  # type: ignore[no-untyped-def]
    global _chosen
    if _chosen is None:
        _chosen = (
            ISAS.index(_forced)
            if _forced is not None
            else next(i for i in range(len(ISAS)) if ext.cpu_has(i))
        )
    return _chosen


def isa_index() -> int:
    """The ISA the native kernels run (an index into ISAS, force_isa's pin included); needs the build."""
    if _chosen is not None:
        return _chosen
    ext = native.extension()
    if ext is None:
        raise RuntimeError(native.failure() or "no native build")
    return _isa_id(ext)


def kernel_path() -> str:
    """ "avx512_vnni", "avx2" or "scalar": what qlinear runs; "torch" without a native build."""
    ext = native.extension()
    return "torch" if ext is None else ISAS[_isa_id(ext)]


def force_isa(name: str | None) -> None:
    """Pin one path ("avx512_vnni", "avx2", "scalar"), for tests; None: the best the CPU has."""
    global _forced, _chosen
    if name is not None:
        if name not in ISAS:
            raise ValueError(f"unknown ISA {name!r}; one of {', '.join(ISAS)}")
        if not _cpu_has(name):
            raise RuntimeError(f"this CPU (or build) cannot run the {name} path")
    _forced = name
    _chosen = None
