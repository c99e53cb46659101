"""The draw on the logits' device, with no host read: `kernels.sampling`'s distribution (its
`_ranked`: temperature, then top-k, top-p and min-p over the whole of it) over every row of the
batch at once, with the same arguments and the same token for the same uniforms and noise as its
reference `sample_rows_ref`, which picks the sampled rows first (`nonzero`, a sync on CUDA).

Every row is ranked, greedy ones included (their temperature read as 1 and their result
discarded by a `where`), so that no shape depends on the values: a CUDA stream runs it without
waiting for the host, and the only copy back is the step's one of the sampled ids. The CPU runs
the native kernel of `kernels.sampling.sample_rows` instead (no sort of the vocabulary); the
engine's sampler picks one of the two once, by the logits' device.
"""

from __future__ import annotations

import torch

from wsllm.kernels.sampling import _ranked  # the distribution's one definition


def draw_rows(
    logits: torch.Tensor,  # [n, vocab] float32
    temp: torch.Tensor,  # [n] float32; <= 0: greedy
    top_k: torch.Tensor,  # [n] int64; <= 0: no limit
    top_p: torch.Tensor,  # [n] float32
    min_p: torch.Tensor,  # [n] float32
    uniform: torch.Tensor,  # [n] float32: each unseeded row's draw
    noise: torch.Tensor,  # [s, vocab] float32: the seeded rows' E ~ Exp(1)
    noise_row: torch.Tensor,  # [n] int64: each row's row of `noise`, -1 for an unseeded row
) -> torch.Tensor:  # [n] int64 token ids
    greedy = logits.argmax(dim=-1)  # greedy rows, and rows with a NaN or no finite best
    drawn = (temp > 0) & logits.amax(dim=-1).isfinite() & ~logits.isnan().any(dim=-1)
    safe = torch.where(drawn[:, None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    t = torch.where(temp > 0, temp, torch.ones((), dtype=temp.dtype, device=temp.device))
    kept, order, drop = _ranked(safe, t, top_k, top_p, min_p)  # [n, vocab] each, in rank order
    cum = kept.cumsum(dim=-1)
    at = torch.searchsorted(cum, uniform[:, None] * cum[:, -1:], right=True)
    picked = order.gather(1, at.clamp(max=logits.shape[1] - 1)).flatten()  # the first cum > u * mass
    if noise.shape[0]:  # seeded rows: the exponential race argmax p / E over their kept tokens
        e = noise[noise_row.clamp(min=0)].gather(1, order)  # [n, vocab] E in rank order
        ratio = (kept / e).masked_fill(drop, -1.0)
        raced = order.gather(1, ratio.argmax(dim=-1, keepdim=True)).flatten()
        picked = torch.where(noise_row >= 0, raced, picked)
    return torch.where(drawn, picked, greedy)
