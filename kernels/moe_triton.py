"""The mixture of experts' pass as Triton kernels, for CUDA (kernels/moe.py has the contract and the
torch reference, `experts_float`): the step's (row, expert) pairs sorted by expert into blocks of
BLOCK_M pairs of one expert each (`align`: torch ops of static shapes, no host sync, so a decode
step replays in a CUDA graph), then two grouped GEMMs over those blocks: gate and up together with
SiLU(gate) * up as the tile's epilogue, and down with the routing weight folded into its output;
each pair's output row summed over its row's k pairs in the order of its ids. Tested in the
interpreter (TRITON_INTERPRET=1) against the reference."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_common import dot_flags


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [L]: pair indices t * k + j sorted by expert, each expert's run padded
    to a multiple of block_m with the sentinel T * k; experts [L / block_m]: each block's expert).
    L = the padded length's bound for any routing, so the shapes depend on T, k and E alone."""
    flat = ids.reshape(-1)
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs by expert, in row order within one
    expert = flat[order]
    rank = torch.arange(p, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    length = triton.cdiv(p + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((length,), p, dtype=torch.int64, device=ids.device)
    pairs[(ends - padded)[expert] + rank] = order
    starts = torch.arange(0, length, block_m, device=ids.device)
    experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, experts


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, pairs_ptr, experts_ptr, h_ptr, P, H, N_I, TOP_K, s_we, ALPHA, LIMIT,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, OAI: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(experts_ptr + b).to(tl.int64)
    pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < P
    row = pair // TOP_K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w_ptr + e * s_we
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + row[:, None] * H + k[None, :], mask=valid[:, None] & (k < H)[None, :], other=0.0)
        wmask = (k < H)[:, None] & (n < N_I)[None, :]
        wg = tl.load(w + n[None, :] * H + k[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]: gate rows
        wu = tl.load(w + (N_I + n)[None, :] * H + k[:, None], mask=wmask, other=0.0)  # up rows
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(a, wg, input_precision=PRECISION)
        acc_u += tl.dot(a, wu, input_precision=PRECISION)
    if HAS_BIAS:  # b [E, 2I]: each expert's gate biases, then its up biases
        acc_g += tl.load(b_ptr + e * 2 * N_I + n, mask=n < N_I, other=0.0)[None, :]
        acc_u += tl.load(b_ptr + e * 2 * N_I + N_I + n, mask=n < N_I, other=0.0)[None, :]
    if OAI:  # gpt-oss's clamped SwiGLU (kernels/moe.py: ExpertAct)
        g = tl.minimum(acc_g, LIMIT)
        u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + pair[:, None] * N_I + n[None, :], h, mask=valid[:, None] & (n < N_I)[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, b_ptr, weights_ptr, pairs_ptr, experts_ptr, y_ptr, P, H, N_I, s_we,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(experts_ptr + b).to(tl.int64)
    pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < P
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w_ptr + e * s_we
    for k0 in range(0, N_I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            h_ptr + pair[:, None] * N_I + k[None, :], mask=valid[:, None] & (k < N_I)[None, :], other=0.0
        )
        wd = tl.load(w + n[None, :] * N_I + k[:, None], mask=(k < N_I)[:, None] & (n < H)[None, :], other=0.0)
        acc += tl.dot(a, wd.to(tl.float32), input_precision=PRECISION)
    if HAS_BIAS:  # b [E, H]
        acc += tl.load(b_ptr + e * H + n, mask=n < H, other=0.0)[None, :]
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    tl.store(
        y_ptr + pair[:, None] * H + n[None, :], acc * weight[:, None], mask=valid[:, None] & (n < H)[None, :]
    )


def moe_experts_triton(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k]
    weights: torch.Tensor,  # [T, k] float32
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor,  # [E, H, I]
    block_m: int | None = None,
    bias: Any = None,  # kernels/moe.py: ExpertBias
    act: Any = None,  # kernels/moe.py: ExpertAct (None: SwiGLU)
) -> torch.Tensor:  # [T, H] in x's dtype
    """kernels/moe.py: experts_float, on the Triton kernels (with the experts' biases and activation)."""
    t, h = x.shape
    e, i2, _ = gate_up.shape
    i, k = i2 // 2, ids.shape[1]
    p = t * k
    cuda = x.device.type == "cuda"
    block_m = block_m or (64 if cuda and p > 64 else 16)
    block_n, block_k = (64, 32) if cuda else (32, 32)
    pairs, experts = align(ids.long(), e, block_m)
    xc, gu, dn = x.contiguous(), gate_up.contiguous(), down.contiguous()
    upcast, precision = dot_flags(x.dtype, x.device)
    hidden = torch.empty((p, i), dtype=torch.float32, device=x.device)
    has_bias, oai = bias is not None, act is not None and act.kind == "swiglu_oai"
    b_gu = bias.gate_up.float().contiguous() if has_bias else hidden  # (unread without a bias)
    b_dn = bias.down.float().contiguous() if has_bias else hidden
    alpha, limit = (float(act.alpha), float(act.limit)) if oai else (1.0, 0.0)
    _gate_up_kernel[(experts.numel(), triton.cdiv(i, block_n))](
        xc, gu, b_gu, pairs, experts, hidden, p, h, i, k, gu.stride(0), alpha, limit,
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=has_bias, OAI=oai,
    )  # fmt: skip
    y = torch.empty((p, h), dtype=torch.float32, device=x.device)
    _, precision32 = dot_flags(torch.float32, x.device)
    _down_kernel[(experts.numel(), triton.cdiv(h, block_n))](
        hidden, dn, b_dn, weights.float().contiguous(), pairs, experts, y, p, h, i, dn.stride(0),
        PRECISION=precision32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=has_bias,
    )  # fmt: skip
    y = y.view(t, k, h)
    out = y[:, 0]
    for j in range(1, k):  # each row's pairs in the order of its ids
        out = out + y[:, j]
    return out.to(x.dtype)
