"""How Qwen3-VL (Qwen2-VL's image processor) sizes an image, in plain arithmetic, and the
prompt text that stands for it: shared by the gateway, which writes an image's placeholder
tokens into the prompt from its size alone, and the engine, which resizes and patchifies the
pixels the same way (wsllm/models/vision/qwen3_vl_pixels.py). No torch, nothing of wsllm.

Dynamic resolution: the image is resized (`resized`, transformers' `smart_resize`) to sides
that are whole multiples of `patch_size * merge_size`, as close to its own as that allows,
its pixels brought within [min_pixels, max_pixels] at its aspect ratio. That is a grid of
`grid_h x grid_w` patches of `patch_size` pixels (each repeated `temporal_patch_size` times:
a still image is one frame of a video), and every `merge_size x merge_size` square of them
becomes one token of the text model: the prompt holds `grid_h * grid_w / merge_size**2`
`<|image_pad|>` tokens where the chat template wrote the image's one."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
MAX_ASPECT = 200  # transformers refuses an image more than 200 times as long as it is wide


@dataclass(frozen=True, slots=True)
class VisionGrid:
    patch_size: int = 16  # Qwen3-VL's (Qwen2-VL's: 14)
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536  # Qwen3-VL's checkpoints' size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge

    def __post_init__(self) -> None:
        if min(self.patch_size, self.merge_size, self.temporal_patch_size) < 1:
            raise ValueError("patch_size, merge_size and temporal_patch_size must be at least 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} must be in (0, max_pixels {self.max_pixels}]")

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any]) -> VisionGrid:
        """From a checkpoint's preprocessor_config.json: `size.shortest_edge` and
        `size.longest_edge` are the pixel bounds (transformers 5; `min_pixels` and
        `max_pixels`, top level or in `size`, as older files say them, take precedence)."""
        size = preprocessor.get("size") or {}
        least = preprocessor.get("min_pixels") or size.get("min_pixels") or size.get("shortest_edge")
        most = preprocessor.get("max_pixels") or size.get("max_pixels") or size.get("longest_edge")
        return cls(
            patch_size=int(preprocessor.get("patch_size", 14)),
            merge_size=int(preprocessor.get("merge_size", 2)),
            temporal_patch_size=int(preprocessor.get("temporal_patch_size", 2)),
            min_pixels=int(least or 56 * 56),
            max_pixels=int(most or 28 * 28 * 1280),
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> VisionGrid | None:
        """A Qwen3-VL (Qwen2-VL image processor) checkpoint's grid, from its
        preprocessor_config.json; None for a directory without one."""
        try:
            pre = json.loads((Path(directory) / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(pre, dict) or not str(pre.get("image_processor_type", "")).startswith(
            "Qwen2VLImageProcessor"
        ):
            return None
        return cls.from_hf(pre)

    @property
    def marker(self) -> str:
        """The text the chat template writes for one image, which `placeholder` replaces."""
        return IMAGE_PAD

    @property
    def factor(self) -> int:
        """A resized side is a multiple of this many pixels (one merged token's side)."""
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size (height, width) the image is resized to (transformers' smart_resize)."""
        if height < 1 or width < 1:
            raise ValueError(f"an image of {width}x{height} pixels has no area")
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise ValueError(f"the image's aspect ratio {width}x{height} is over {MAX_ASPECT}:1")
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f  # half to even, as transformers rounds
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The image's patches as (frames, rows, cols): HF's `image_grid_thw`."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """The text model's tokens for one image of this size (its `<|image_pad|>`s)."""
        t, rows, cols = self.grid(height, width)
        return t * rows * cols // self.merge_size**2

    def placeholder(self, height: int, width: int) -> str:
        """The prompt text that replaces the template's `marker` for one image of this size
        (each `<|image_pad|>` one token; the template writes the vision start and end)."""
        return IMAGE_PAD * self.num_tokens(height, width)
