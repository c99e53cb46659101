"""The quantized arithmetic in plain torch: the test oracle of the kernels and their fallback.

The rule (the kernels in kernels/cpu/ do exactly this, docs/kernels.md):

1. Each row of x is cut in blocks of 32 values (Q4_0, Q4_1, Q8_0, MXFP4) or 256 (the K-quants),
   and each block becomes int8 with one float32 scale: d = amax * (1 / 127), q = round(x / d)
   (ties to even), written round(x * (1 / d)). Sums of every 16 quants are kept.
2. Per weight block an integer dot product with the quants (exact: no rounding at all).
3. The float part per block, in this order, with the weight's fp16 scales made float32:
   Q4_0, Q8_0, MXFP4:  t = (dw * dx) * sumi   (MXFP4: dw = 2 ** (e - 128), quants its doubled E2M1 values)
   Q4_1:        t = (dw * dx) * sumi + (mw * dx) * sum(xq)
   Q4_K, Q5_K:  t = (dw * dx) * sum_j(sc_j * sumi_j) - (dmin * dx) * sum_j(mn_j * sum_j(xq))
   Q6_K:        t = (dw * dx) * sum_j(sc_j * sumi_j)            (j: the 16-value groups)
4. out = ((t_0 + t_1) + t_2) + ... over the blocks in order, then + bias, then x's dtype.

Because the order of every float operation is fixed, the kernels give the same bits.
Integer dot products run as float32 matmuls here: every partial sum is an integer below
2**24, so they are exact whatever order BLAS adds them in.
"""

from __future__ import annotations

import torch

from .quant_formats import BLOCK, BlockParts

_INV127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)
_MAX_DOT_ELEMS = 1 << 24  # bound on the [groups, M, N] dot product tensor per chunk of x rows


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: float32 [M, K] -> (q float32 [M, K/block, block] of int8 values, d [M, K/block],
    sums int32 [M, K/16] of every 16 quants)."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    d = xb.abs().amax(dim=-1) * _INV127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    sums = q.reshape(m, k // 16, 16).sum(dim=-1).to(torch.int32)
    return q, d, sums


def _int_dots(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq: [M, G, L], wq: [N, G, L] small integers -> int32 [G, M, N] (exact, see above)."""
    dots = torch.bmm(xq.transpose(0, 1), wq.float().permute(1, 2, 0))
    return dots.to(torch.int32)


def _block_terms(qtype: str, w: BlockParts, xq: torch.Tensor, dx: torch.Tensor, sums: torch.Tensor):
    """The per-block float terms t: [blocks, M, N] for rows xq [M, blocks, block] of x."""
    m, nb, bs = xq.shape
    n = w.q.shape[0]
    dwdx = w.d.t()[:, None, :] * dx.t()[:, :, None]  # [blocks, M, N]
    if qtype in ("Q4_0", "Q8_0", "Q4_1", "MXFP4"):
        t = dwdx * _int_dots(xq, w.q).float()
        if qtype == "Q4_1":
            assert w.m is not None
            xsum = (sums[:, 0::2] + sums[:, 1::2]).t()[:, :, None].float()  # [blocks, M, 1]
            t = t + (w.m.t()[:, None, :] * dx.t()[:, :, None]) * xsum
        return t
    sub = 16 if qtype == "Q6_K" else 32
    per = bs // sub  # sub-blocks per block
    dots = _int_dots(xq.reshape(m, nb * per, sub), w.q.reshape(n, nb * per, sub)).reshape(nb, per, m, n)
    assert w.sc is not None
    sc = w.sc.permute(1, 2, 0)[:, :, None, :]  # [blocks, per, 1, N]
    if qtype == "Q6_K":
        isum = (sc * dots).sum(dim=1)  # q carries its -32
        return dwdx * isum.float()
    xs = sums.reshape(m, nb, 16).permute(1, 2, 0)  # [blocks, 16, M]
    xs32 = (xs[:, 0::2] + xs[:, 1::2])[..., None]  # [blocks, 8, M, 1]
    assert w.mn is not None and w.m is not None
    isum = (sc * dots).sum(dim=1)
    msum = (w.mn.permute(1, 2, 0)[:, :, None, :] * xs32).sum(dim=1)
    dmdx = w.m.t()[:, None, :] * dx.t()[:, :, None]
    return dwdx * isum.float() - dmdx * msum.float()


def qlinear_parts(
    qtype: str,
    x: torch.Tensor,
    w: BlockParts,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [M, K] float32 or bfloat16 -> [M, N] in out_dtype (default x's), by the rule above."""
    xf = x.float()
    m, k = xf.shape
    n, nb = w.d.shape
    out = torch.empty(m, n, dtype=torch.float32)
    step = max(1, _MAX_DOT_ELEMS // max(1, n * k // 16))
    for lo in range(0, m, step):
        xq, dx, sums = quantize_activations(xf[lo : lo + step], BLOCK[qtype][0])
        t = _block_terms(qtype, w, xq, dx, sums)
        acc = t[0].clone()
        for b in range(1, nb):
            acc = acc + t[b]
        out[lo : lo + step] = acc
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


# -- GGUF quantization (equal to gguf.quants.quantize, which runs numpy) --------------------------


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    # a true division, as numpy's: torch may multiply by the reciprocal of a Python scalar
    return a / torch.full_like(a, b)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    # round half away from zero, as gguf's np_roundf computes it
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def quantize_blocks(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """blocks: float32 [B, 32] -> GGUF bytes uint8 [B, type_size]."""
    if qtype == "Q8_0":
        d = _div(blocks.abs().amax(dim=1, keepdim=True), 127)
        qs = _roundf(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_f16_bytes(d), qs], dim=1)
    if qtype == "Q4_0":
        imax = blocks.abs().argmax(dim=-1, keepdim=True)
        d = _div(torch.gather(blocks, -1, imax), -8)
        q = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15)
        return torch.cat([_f16_bytes(d), _nibbles(q)], dim=1)
    if qtype == "Q4_1":
        hi, lo = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)
        d = _div(hi - lo, 15)
        q = torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp(0, 15)
        return torch.cat([_f16_bytes(d), _f16_bytes(lo), _nibbles(q)], dim=1)
    raise NotImplementedError(f"quantizing to {qtype} is not supported (Q8_0, Q4_0, Q4_1 are)")
