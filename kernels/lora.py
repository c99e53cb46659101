"""The grouped low-rank pass of LoRA adapters, as S-LoRA's and Punica's kernels split it:

    for each group g (one adapter and the rows of the batch that use it),
      for each piece p of the adapter's projection (q, k and v of a fused qkv; gate and up):
        t = x[rows_g] @ A_p.T                   # shrink: [m, r]
        y[rows_g, off_p : off_p + n_p] += t @ BT_p   # expand: BT_p = B_p.T * scaling, [r, n_p]

`y` is the base projection's output, computed once for the whole batch; an adapter that
no row uses is not in the groups and costs nothing. Pieces are float32, or bfloat16 under a
bfloat16 model (`LoraPiece`: half the bytes, which a decode step of one row is bound by),
`x` and `y` the activations' dtype (float32 or bfloat16; float16 on CUDA); the sums run in
float32 and `y` is rounded once, when the delta is added.

Three versions with one signature:
- `lora_apply_ref`: plain torch, the oracle and the path without a native build;
- `lora_apply_cpu`: one call of the native kernels (kernels/cpu/lora.cpp, the vector code in
  cpu/lora_simd.h compiled for AVX-512 and AVX2) for every group of a projection, each row
  computed in the same order whatever else the batch holds (so a row's bits do not depend on
  its batch);
- `lora_apply_triton` (kernels/lora_triton.py, loaded on first use): the shrink and the
  expand as Triton kernels, for CUDA (tested in the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._lazy import triton_op

#: the projections of a decoder layer an adapter may touch, in the decode stack's order
SLOTS = ("qkv", "o", "gate_up", "down")
#: the widest rank the native kernels take (their scratch of one row's shrink)
MAX_NATIVE_RANK = 256


@dataclass(slots=True)
class LoraPiece:
    """One adapted module of a projection (q_proj of the fused qkv, gate_proj of gate_up)."""

    a: torch.Tensor  # [r, K] float32 (or bfloat16 under a bfloat16 model), contiguous: lora_A
    bt: torch.Tensor  # [r, n] the same type, contiguous: lora_B transposed, times the scaling
    offset: int  # its first column in the projection's output

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


#: one group of a step: the adapter's pieces of this projection, and its rows (None: every row)
Group = tuple[list[LoraPiece], torch.Tensor | None]


def lora_apply_ref(y: torch.Tensor, x: torch.Tensor, groups: list[Group]) -> None:
    """y [M, N] += each group's low-rank delta, in place; x [M, K]."""
    for pieces, rows in groups:
        if not pieces:
            continue
        xs = (x if rows is None else x.index_select(0, rows)).float()  # [m, K]
        for p in pieces:
            n = p.bt.shape[1]
            delta = (xs @ p.a.float().t()) @ p.bt.float()  # [m, n] float32
            out = y[:, p.offset : p.offset + n]
            if rows is None:
                out.copy_((out.float() + delta).to(y.dtype))
            else:
                got = out.index_select(0, rows).float() + delta
                out.index_copy_(0, rows, got.to(y.dtype))


class NativeLora:
    """An adapter's pieces handed to the native kernels once (`ext.LoraWeights`): per
    (layer, projection) its pieces, kept alive by the object."""

    def __init__(self, ext: Any, pieces: dict[tuple[int, int], list[LoraPiece]]) -> None:
        keys, a, bt, offsets = [], [], [], []
        for (layer, slot), ps in sorted(pieces.items()):
            for p in ps:
                keys.append(layer * len(SLOTS) + slot)
                a.append(p.a)
                bt.append(p.bt)
                offsets.append(p.offset)
        self.handle = ext.LoraWeights(keys, a, bt, offsets)


EMPTY_ROWS = torch.empty(0, dtype=torch.long)  # the native kernels' "every row"


def lora_apply_cpu(
    y: torch.Tensor, x: torch.Tensor, key: int, handles: list[Any], rows: list[torch.Tensor | None]
) -> None:
    """The native grouped pass of projection `key` (layer * 4 + slot) for every group at
    once: `handles[g]` an adapter's NativeLora.handle, `rows[g]` its rows (None: all)."""
    from . import cpu_ops

    ext = cpu_ops.native_ext()
    ext.lora_apply(y, x, key, handles, [EMPTY_ROWS if r is None else r for r in rows], cpu_ops.native_isa())


def native_lora_ok(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the native kernels take these activations (float32 or bfloat16 CPU rows)."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and y.dtype is x.dtype
        and x.is_contiguous()
        and y.is_contiguous()
    )


def __getattr__(name: str) -> Any:
    # The Triton version is in lora_triton.py, imported on first use; see _lazy.py.
    if name == "lora_apply_triton":
        return triton_op(__package__, "lora_triton", name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
