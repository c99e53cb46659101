"""One draw per row of a batch of logits: the engine's sampler (wsllm/engine/sampler.py) hands its
rows here once their bias, grammar masks, penalties and min_tokens are applied.

The distribution (both paths below): a row with temperature T <= 0 takes its argmax (the first
largest; a NaN counts as the largest, as in torch.argmax). Any other row draws from
p = softmax(l / T) restricted to its kept set: rank its tokens by p (ties to the lower id) and keep
rank r while r < top_k (when 0 < top_k < vocab), the mass of the tokens ranked before it is below
top_p, and p >= min_p * p_max; the best token always stays. top_k, top_p and min_p each read the
whole distribution, as vLLM and HF apply them when given alone; none renormalises before another.

The draw: an unseeded row takes its uniform u (the engine draws one per row, for the batch, in one
call) through the inverse CDF of its kept mass; a seeded row runs the exponential race
argmax p / E over its own noise E ~ Exp(1) (a generator keyed by seed, choice and position, as
earlier releases drew, so its tokens are theirs and independent of its batch). Both are exact
samples of the kept distribution.

`sample_rows` runs the native kernel (kernels/cpu/sample.cpp: no sort of the vocabulary, the rows
in parallel) on CPU float32 logits with the native build, else `sample_rows_ref`, which follows the
definition literally: a full sort per row (the oracle of tests/unit/test_sampling_dist.py).
"""

from __future__ import annotations

import torch

from . import cpu_ops

# The argument list of both paths: logits [n, vocab] float32; per row temp, top_p, min_p, uniform
# (float32 [n]), top_k (int64 [n], <= 0: no limit); noise [s, vocab] float32, the seeded rows' E, and
# noise_row (int64 [n]) each row's row of it, -1 for a row that draws by its uniform.


def sample_rows(
    logits: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    noise_row: torch.Tensor,
) -> torch.Tensor:  # [n] int64 token ids
    if logits.device.type == "cpu" and logits.dtype is torch.float32 and logits.stride(-1) == 1:
        ext = cpu_ops.native_ext()
        if ext is not None:
            isa = cpu_ops.native_isa()
            return ext.sample_rows(logits, temp, top_k, top_p, min_p, uniform, noise, noise_row, isa)
    return sample_rows_ref(logits, temp, top_k, top_p, min_p, uniform, noise, noise_row)


def _ranked(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition on sampled rows [r, vocab] with finite bests: (e in rank order with the dropped
    tokens 0, the ranks' token ids, which ranks are dropped)."""
    vocab = logits.shape[1]
    s = logits / temp[:, None]
    e = (s - s.amax(dim=-1, keepdim=True)).exp()  # the best token's e is 1
    z = e.sum(dim=-1, keepdim=True)
    sorted_e, order = e.sort(dim=-1, descending=True, stable=True)  # ranks, ties to the lower id
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    before = sorted_e.cumsum(dim=-1) - sorted_e
    drop |= (before >= top_p[:, None] * z) & (top_p[:, None] < 1)
    drop |= sorted_e < min_p[:, None]
    drop[:, 0] = False
    return sorted_e.masked_fill(drop, 0.0), order, drop


def kept_probs(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The distribution each sampled row [n, vocab] draws from (temp > 0, finite logits), by vocabulary id."""
    kept, order, _ = _ranked(logits, temp, top_k, top_p, min_p)
    return torch.zeros_like(kept).scatter_(1, order, kept / kept.sum(dim=-1, keepdim=True))


def sample_rows_ref(
    logits: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    noise_row: torch.Tensor,
) -> torch.Tensor:
    out = logits.argmax(dim=-1)  # greedy rows, and rows with a NaN or no finite best
    peak = logits.amax(dim=-1)
    rows = ((temp > 0) & peak.isfinite() & ~logits.isnan().any(dim=-1)).nonzero().flatten()
    if rows.numel() == 0:
        return out
    kept, order, drop = _ranked(logits[rows], temp[rows], top_k[rows], top_p[rows], min_p[rows])
    cum = kept.cumsum(dim=-1)
    target = uniform[rows, None] * cum[:, -1:]
    at = torch.searchsorted(cum, target, right=True).clamp(
        max=logits.shape[1] - 1
    )  # the first cum > u * mass
    picked = order.gather(1, at).flatten()
    seeded = (noise_row[rows] >= 0).nonzero().flatten()
    if seeded.numel():
        ratio = kept[seeded] / noise[noise_row[rows[seeded]]].gather(1, order[seeded])  # E in rank order
        ratio[drop[seeded]] = -1.0
        picked[seeded] = order[seeded].gather(1, ratio.argmax(dim=-1, keepdim=True)).flatten()
    out[rows] = picked
    return out
