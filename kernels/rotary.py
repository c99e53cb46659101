"""Rotary position embedding (NeoX / HF Llama layout: rotate the two halves)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ._lazy import triton_op


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


def _yarn_inv_freq(
    head_dim: int, base: float, max_pos: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek, Qwen's long contexts): the frequencies interpolated by `factor`
    below the wavelengths of `beta_slow` rotations over the original context and extrapolated
    above those of `beta_fast`, a linear ramp between; and the attention factor cos and sin are
    scaled by (0.1 ln(factor) + 1 unless given). `truncate` (default on, off in gpt-oss): the
    ramp's ends rounded to whole dimensions. As transformers' _compute_yarn_parameters."""
    old = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_pos / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `old`
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolated) + (1.0 / pos) * extrapolated
    return inv_freq, float(attention)


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def longrope_cos_sin_cache(head_dim: int, base: float, max_pos: int, scaling: dict[str, Any]) -> torch.Tensor:
    """LongRoPE (Phi-3/3.5/4-mini): each frequency divided by its factor, the short factors at the
    positions below `original_max_position_embeddings`, the long ones from there on; cos and sin
    times the attention factor (given, or sqrt(1 + ln(s) / ln(original)) with s = max_pos /
    original). Per position, so a position's rotation never depends on its batch or on how long
    its sequence grows, and a cached block stays exact: HF's generate token for token while a
    sequence stays within the original length. Past it the peers differ from this and from each
    other: HF drops a sequence's cache when it first crosses and recomputes every position with
    the long factors, vLLM takes the long set for a whole batch once any of its positions is past,
    llama.cpp one set for its context size (docs/models.md)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_pos / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    parts = []
    for key, lo, hi in (("short_factor", 0, min(original, max_pos)), ("long_factor", original, max_pos)):
        if hi <= lo:
            continue
        inv_freq = 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * base**shape)
        freqs = torch.outer(torch.arange(lo, hi, dtype=torch.int64).float(), inv_freq)
        parts.append(torch.cat([freqs.cos() * attention, freqs.sin() * attention], dim=-1))
    return torch.cat(parts)


def compute_cos_sin_cache(
    head_dim: int, base: float, max_pos: int, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """-> [max_pos, head_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = _inv_freq(head_dim, base)
    kind = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    attention = 1.0  # cos and sin times this (YaRN's attention factor)
    if kind in ("longrope", "su"):
        return longrope_cos_sin_cache(head_dim, base, max_pos, rope_scaling or {})
    if kind == "yarn":
        inv_freq, attention = _yarn_inv_freq(head_dim, base, max_pos, rope_scaling or {})
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
    elif kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]  # type: ignore[index]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported")
    t = torch.arange(max_pos, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim / 2]
    cs = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return cs if attention == 1.0 else cs * attention


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]
) -> None:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half:].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        x[..., :half] = o1.to(x.dtype)
        x[..., half:] = o2.to(x.dtype)


def __getattr__(name: str) -> Any:
    # The Triton version is in elementwise.py, imported on first use; see _lazy.py.
    if name in ("rotary_embedding_triton",):
        return triton_op(__package__, "elementwise", name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
