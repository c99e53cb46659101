"""The grouped LoRA pass as Triton kernels (kernels/lora.py has the contract and the torch
reference): for each group (an adapter and its rows) and each piece of its projection, a
shrink (`t = x[rows] @ A.T`, float32) and an expand (`y[rows, offset:offset + n] += t @ BT`,
summed in float32 and rounded to y's dtype once), each program one row and one block of
columns; the rows are read and written in place through their indices (no gather).
Tested in the interpreter (TRITON_INTERPRET=1) against the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import next_pow2
from .lora import Group


@triton.jit
def _shrink_kernel(
    x_ptr, rows_ptr, a_ptr, t_ptr, K, R, s_x, s_t,
    ALL_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1)
    row = i if ALL_ROWS else tl.load(rows_ptr + i).to(tl.int64)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * s_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + r[:, None] * K + k[None, :], mask=(r < R)[:, None] & (k < K)[None, :], other=0.0)
        a = a.to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + i * s_t + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    t_ptr, bt_ptr, rows_ptr, y_ptr, R, N, offset, s_t, s_y,
    ALL_ROWS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    row = i if ALL_ROWS else tl.load(rows_ptr + i).to(tl.int64)
    r = tl.arange(0, R_PAD)
    c = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.load(t_ptr + i * s_t + r, mask=r < R, other=0.0)
    bt = tl.load(bt_ptr + r[:, None] * N + c[None, :], mask=(r < R)[:, None] & (c < N)[None, :], other=0.0)
    bt = bt.to(tl.float32)
    delta = tl.sum(t[:, None] * bt, axis=0)
    out = y_ptr + row * s_y + offset + c
    y = tl.load(out, mask=c < N, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=c < N)


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, groups: list[Group]) -> None:
    """y [M, N] += each group's low-rank delta, in place; x [M, K] (rows with a unit stride)."""
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_apply_triton needs rows with a unit stride")
    m_all, k = x.shape
    for pieces, rows in groups:
        m = m_all if rows is None else rows.numel()
        if not pieces or m == 0:
            continue
        rows_arg = x if rows is None else rows  # (unread when every row)
        for p in pieces:
            r, n = p.a.shape[0], p.bt.shape[1]
            a, bt = p.a.to(x.device), p.bt.to(x.device)
            t = torch.empty((m, r), dtype=torch.float32, device=x.device)
            block_r = min(next_pow2(r), 32)
            _shrink_kernel[(m, triton.cdiv(r, block_r))](
                x, rows_arg, a, t, k, r, x.stride(0), t.stride(0),
                ALL_ROWS=rows is None, BLOCK_R=block_r, BLOCK_K=min(next_pow2(k), 128),
            )  # fmt: skip
            block_n = 64
            _expand_kernel[(m, triton.cdiv(n, block_n))](
                t, bt, rows_arg, y, r, n, p.offset, t.stride(0), y.stride(0),
                ALL_ROWS=rows is None, R_PAD=next_pow2(r), BLOCK_N=block_n,
            )  # fmt: skip
