"""What a row's parameters do to its logits before the draw, as tensor ops on the logits'
device. The host only decides where (which rows and columns, from the tokens a row has seen):
its index and value tensors travel to the device ahead of the ops, so no op waits for the host
and none reads a device value back.

Order (Sampler): `logit_bias` is added, a structured row's grammar masks every token it does not
allow to -inf (one bitmask of 32-token words for all such rows, filled by llguidance on the host,
unpacked by numpy on the CPU and on the device elsewhere), then penalties on the tokens a row
has seen (its own columns only: the same values a dense [rows, vocab] pass gives, element for
element), then `min_tokens` (its stop tokens and EOS masked until it has that many).

A "row" here is anything with a sequence's `params`, `output_token_ids` and `token_ids`
(sampler.RowView: a sequence as it stands at one row of its verification).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory, asynchronously (a plain copy
    would first wait for the work queued before it)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def needs_penalties(p: Any) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def bias_index(rows: list[Any], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """(rows, cols, values) of every row's logit_bias, on the device; None when no row has one."""
    r: list[int] = []
    c: list[int] = []
    v: list[float] = []
    for i, s in enumerate(rows):
        if s.params.logit_bias:
            r += [i] * len(s.params.logit_bias)
            c += s.params.logit_bias.keys()
            v += s.params.logit_bias.values()
    if not r:
        return None
    host = (torch.tensor(r), torch.tensor(c), torch.tensor(v, dtype=torch.float32))
    return tuple(to_device(t, device) for t in host)


def add_bias(logits: torch.Tensor, at: tuple[torch.Tensor, ...]) -> None:
    """logit_bias, in place."""
    logits.index_put_((at[0], at[1]), at[2].to(logits.dtype), accumulate=True)


def penalty_index(rows: list[Any], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """((row, col) of each token a penalised row has seen, its repetition penalty (1 where none),
    its frequency penalty times its count, its presence penalty where counted), on the device."""
    rs: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    rep: list[np.ndarray] = []
    sub: list[np.ndarray] = []
    pres: list[np.ndarray] = []
    for i, s in enumerate(rows):
        p = s.params
        if not needs_penalties(p):
            continue
        out, counts = np.unique(np.asarray(s.output_token_ids, dtype=np.int64), return_counts=True)
        # Repetition penalty (HF / CTRL): over prompt and output tokens.
        seen = (
            np.unique(np.asarray(list(s.token_ids), dtype=np.int64))
            if p.repetition_penalty != 1.0
            else out[:0]
        )
        ids = np.union1d(seen, out)
        n = np.zeros(len(ids), dtype=np.float32)
        n[np.searchsorted(ids, out)] = counts
        rs.append(np.full(len(ids), i, dtype=np.int64))
        cols.append(ids)
        rep.append(np.where(np.isin(ids, seen), np.float32(p.repetition_penalty), np.float32(1.0)))
        # Presence and frequency penalties (OpenAI): over output tokens only.
        sub.append(np.float32(p.frequency_penalty) * n)
        pres.append(np.where(n > 0, np.float32(p.presence_penalty), np.float32(0.0)))
    if not rs:
        return None
    return tuple(to_device(torch.from_numpy(np.concatenate(a)), device) for a in (rs, cols, rep, sub, pres))


def apply_penalties(logits: torch.Tensor, at: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A copy of logits with the penalties of `penalty_index` on their tokens."""
    logits = logits.clone()
    rows, cols, r, f, p = at
    v = logits[rows, cols]
    logits[rows, cols] = torch.where(r != 1.0, torch.where(v > 0, v / r, v * r), v) - f - p
    return logits


def stop_index(rows: list[Any], eos_ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """(rows, cols) a row may not take yet: min_tokens keeps its stop tokens and EOS away until
    it has that many (except where a grammar decides: it allows EOS only once complete)."""
    r: list[int] = []
    c: list[int] = []
    for i, s in enumerate(rows):
        if len(s.output_token_ids) < s.params.min_tokens and s.matcher is None:
            banned = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else eos_ids)
            r += [i] * len(banned)
            c += banned
    if not r:
        return None
    return to_device(torch.tensor(r), device), to_device(torch.tensor(c), device)


def mask_stops(logits: torch.Tensor, at: tuple[torch.Tensor, ...]) -> torch.Tensor:
    logits = logits.clone()
    logits[at[0], at[1]] = float("-inf")
    return logits


# words: [n, ceil(vocab / 32)] int32, bit b of word w is token 32 * w + b; both give [n, vocab] bools


def unpack_bits_numpy(words: np.ndarray, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # little-endian words
    return torch.from_numpy(bits[:, :vocab].view(np.bool_))


def unpack_bits_torch(words: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()


def mask_grammar(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> None:
    """Every token a structured row's grammar forbids to -inf, in place: `allowed` [n, vocab]
    for the rows `rows` of the batch, in order."""
    forbid = ~allowed
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(forbid, float("-inf"))
        return
    for j, i in enumerate(rows):  # row by row, in place: cheaper than gathering and scattering
        logits[i].masked_fill_(forbid[j], float("-inf"))
