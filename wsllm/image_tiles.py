"""How SmolVLM (Idefics3) cuts an image into tiles, in plain arithmetic, and the prompt
text that stands for them: shared by the gateway, which writes an image's placeholder
tokens into the prompt from its size alone, and the engine, which cuts the pixels the
same way (wsllm/models/vision/idefics3_pixels.py). No torch, nothing of wsllm.

The image is resized so that its longest edge is `longest_edge` (even sides, within
4096), then up to whole tiles of `tile` pixels; an image larger than one tile is cut
into `rows x cols` tiles and is followed by a global view (the whole image resized to
one tile); a smaller one is one tile. Each tile is `tokens_per_tile` `<image>` tokens,
named by `<row_R_col_C>` (the global view by `<global-img>`), as transformers'
Idefics3Processor writes them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SIDE = 4096  # transformers' absolute maximum side
IMAGE = "<image>"
AROUND = "<fake_token_around_image>"
GLOBAL = "<global-img>"


@dataclass(frozen=True, slots=True)
class Tiling:
    longest_edge: int  # the image is resized to this longest edge first
    tile: int  # a tile's side in pixels (the encoder's image size)
    tokens_per_tile: int
    splitting: bool = True

    @property
    def marker(self) -> str:
        """The text the chat template writes for one image, which `placeholder` replaces."""
        return IMAGE

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any], tokens_per_tile: int) -> Tiling:
        """From a checkpoint's preprocessor_config.json and its image tokens per tile
        (processor_config.json's `image_seq_len`)."""
        return cls(
            longest_edge=preprocessor.get("size", {}).get("longest_edge", 4 * 364),
            tile=preprocessor.get("max_image_size", {}).get("longest_edge", 364),
            tokens_per_tile=tokens_per_tile,
            splitting=preprocessor.get("do_image_splitting", True),
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tiling | None:
        """An Idefics3 (SmolVLM) checkpoint's tiling, from its preprocessor_config.json
        and processor_config.json (`image_seq_len`, transformers' default 169 without
        it); None for a directory without an Idefics3 image processor: a model that
        reads text only."""
        pre = _json(Path(directory) / "preprocessor_config.json")
        if not str(pre.get("image_processor_type", "")).startswith("Idefics3"):
            return None
        proc = _json(Path(directory) / "processor_config.json")
        return cls.from_hf(pre, int(proc.get("image_seq_len", 169)))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size (height, width) the image is first resized to."""
        height, width = _longest_edge(height, width, self.longest_edge)
        return _within(height, width, MAX_SIDE)

    def encoder_size(self, height: int, width: int) -> tuple[int, int]:
        """The size the resized image is brought to: whole tiles (or one tile, unsplit)."""
        if not self.splitting:
            return self.tile, self.tile
        t = self.tile
        aspect = width / height
        if width >= height:
            width = math.ceil(width / t) * t
            height = math.ceil(int(width / aspect) / t) * t
        else:
            height = math.ceil(height / t) * t
            width = math.ceil(int(height * aspect) / t) * t
        return height, width

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """An image's tiles as (rows, cols) from its original size; (0, 0): one tile, no
        global view."""
        h, w = self.encoder_size(*self.resized(height, width))
        if h > self.tile or w > self.tile:
            return (h - self.tile) // self.tile + 1, (w - self.tile) // self.tile + 1
        return 0, 0

    def num_tiles(self, height: int, width: int) -> int:
        rows, cols = self.grid(height, width)
        return rows * cols + 1 if rows or cols else 1

    def placeholder(self, height: int, width: int) -> str:
        """The prompt text one image of this size stands as (each `<image>` one token)."""
        rows, cols = self.grid(height, width)
        tokens = IMAGE * self.tokens_per_tile
        view = f"{AROUND}{GLOBAL}{tokens}{AROUND}"
        if not rows and not cols:
            return view
        lines = "".join(
            "".join(f"{AROUND}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{lines}\n{view}"


def _json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """Longest edge to `longest`, the other in proportion and made even (transformers')."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _within(height: int, width: int, most: int) -> tuple[int, int]:
    """Scaled down, in proportion, so that neither side is over `most`."""
    aspect = width / height
    if width >= height and width > most:
        width = most
        height = int(width / aspect)
    elif height > width and height > most:
        height = most
        width = int(height * aspect)
    return max(height, 1), max(width, 1)
