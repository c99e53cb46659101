"""Qwen3-VL's multimodal rotary positions (HF's `get_rope_index`) and the rotary rows they
turn q and k by.

Each token has three positions, (t, h, w). A text token's three are one number, counting on
from the token before; an image's tokens, a `rows x cols` grid (merged patches), all take
t = p (p: where the image starts in that count), h = p + row and w = p + col, and the count
goes on after the image from p + max(rows, cols). A prompt of n tokens thus ends at a
smaller position than n - 1: its `delta` (<= 0) is what every later token adds to its index,
so decode positions need no 3-D rows at all, only index + delta.

Interleaved M-RoPE: frequency i of a head's half (the kernels' pair (i, i + head_dim / 2))
turns by the h position where i % 3 == 1 and i < 3 * sections[1], by the w position where
i % 3 == 2 and i < 3 * sections[2], else by the t position. Where t = h = w (every text
token), a row is the 1-D table's row at that position, bit for bit: `rope_rows` gathers from
the model's own table (CausalLM.cos_sin_cache), so text-only prompts and decode steps read
the ordinary table at index + delta."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """An image's tokens in a prompt: where they start and their merged grid."""

    start: int  # its first placeholder token's index in the prompt
    rows: int  # merged-patch rows (HF's grid_h / merge_size)
    cols: int

    @property
    def length(self) -> int:
        return self.rows * self.cols


def axes(head_dim: int, sections: Sequence[int]) -> torch.Tensor:
    """Which position (0 t, 1 h, 2 w) each of a head's head_dim / 2 frequencies turns by."""
    half = head_dim // 2
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(
            f"mrope_section {list(sections)} must be three numbers summing to head_dim / 2 = {half}"
        )
    i = torch.arange(half)
    out = torch.zeros(half, dtype=torch.long)
    out[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    out[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return out


def positions(num_tokens: int, images: Sequence[ImageGrid]) -> tuple[torch.Tensor, int]:
    """The 3-D positions [3, num_tokens] (int64) of a prompt whose images' tokens lie where
    `images` say (in prompt order, apart), and its delta: the position of token index j >=
    num_tokens is j + delta on all three rows (any tokens past the last image, e.g. a
    prompt recomputed with its output, get exactly that here too)."""
    out = torch.empty(3, num_tokens, dtype=torch.long)
    at, pos = 0, 0  # the next token's index, and its position
    for im in images:
        if im.start < at or im.start + im.length > num_tokens or im.rows < 1 or im.cols < 1:
            raise ValueError(
                f"an image of {im.rows}x{im.cols} tokens at {im.start} does not fit after {at} in {num_tokens}"
            )
        out[:, at : im.start] = torch.arange(pos, pos + im.start - at)
        pos += im.start - at
        end = im.start + im.length
        out[0, im.start : end] = pos
        out[1, im.start : end] = (pos + torch.arange(im.rows)).repeat_interleave(im.cols)
        out[2, im.start : end] = (pos + torch.arange(im.cols)).repeat(im.rows)
        pos += max(im.rows, im.cols)
        at = end
    out[:, at:] = torch.arange(pos, pos + num_tokens - at)
    top = int(out.max()) if num_tokens else -1
    return out, top + 1 - num_tokens


def rope_rows(cos_sin_cache: torch.Tensor, pos3: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Each token's rotary row [n, head_dim] (cos | sin halves, as the kernels read a table)
    from the model's 1-D table [max_pos, head_dim] and its 3-D positions [3, n]: pass it as
    the table with positions arange(n)."""
    half = cos_sin_cache.shape[-1] // 2
    axis = axis.to(pos3.device)
    at = pos3[axis].T  # [n, half]: each frequency's position
    col = torch.arange(half, device=pos3.device)
    return torch.cat([cos_sin_cache[at, col], cos_sin_cache[at, col + half]], dim=-1)
