"""Qwen3-VL's image preprocessing in the engine: an image as the vision tower's flattened
patches, sized as `wsllm.image_grid.VisionGrid` says (the gateway wrote as many placeholders
into the prompt from the same arithmetic). The pixels are transformers' exactly (its Qwen2-VL
image processor, PIL backend): Pillow's BICUBIC resize of the 8-bit image, rescaled and
normalized in float32, then cut into patches in the order the patch merger folds them."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image as PILImage

from wsllm.image_grid import VisionGrid
from wsllm.models.vision.idefics3_pixels import rgb
from wsllm.models.vision.qwen3_vl_rope import ImageGrid

# transformers' OPENAI_CLIP_MEAN and _STD: Qwen2-VL's defaults (Qwen3-VL's files say 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class PixelSpec:
    grid: VisionGrid
    mean: tuple[float, ...]  # per channel
    std: tuple[float, ...]
    rescale: float = 1 / 255

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any]) -> PixelSpec:
        resample = preprocessor.get("resample", PILImage.Resampling.BICUBIC)
        if resample != PILImage.Resampling.BICUBIC:
            raise ValueError(f"preprocessor resample {resample} is not served (Qwen2-VL's is BICUBIC, 3)")
        return cls(
            VisionGrid.from_hf(preprocessor),
            tuple(preprocessor.get("image_mean", CLIP_MEAN)),
            tuple(preprocessor.get("image_std", CLIP_STD)),
            preprocessor.get("rescale_factor", 1 / 255),
        )


def patches(image: PILImage.Image, spec: PixelSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One RGB image (`idefics3_pixels.rgb` of its file) as the tower's input: its patches
    [rows * cols, 3 * temporal * patch * patch] float32, each `merge x merge` square of
    patches consecutive (row by row within the square, the squares row by row), each patch
    its channels, then its frames (the image repeated), then its pixels; and its grid
    (1, rows, cols): HF's `pixel_values` and `image_grid_thw`."""
    g = spec.grid
    h, w = g.resized(image.height, image.width)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), PILImage.Resampling.BICUBIC)
    arr = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # [3, h, w]
    x = (arr.astype(np.float64) * spec.rescale).astype(np.float32)
    mean = np.asarray(spec.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    p, m, t = g.patch_size, g.merge_size, g.temporal_patch_size
    rows, cols = h // p, w // p
    # [c, square row, row in square, pixel row, square col, col in square, pixel col]
    x = x.reshape(3, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the frames: one image
    return torch.from_numpy(np.ascontiguousarray(x).reshape(rows * cols, 3 * t * p * p)), (1, rows, cols)


def prepare(data: bytes, spec: PixelSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image file (checked by the gateway) as the tower's patches and grid."""
    return patches(rgb(data), spec)


def prompt_grid(data: bytes, spec: PixelSpec, start: int) -> ImageGrid:
    """Where an image's tokens lie in its prompt and their merged grid, for the 3-D rotary
    positions (qwen3_vl_rope.positions), from its file's header alone: a prefill whose
    image rows come from the encoder cache needs its grid without decoding it."""
    with PILImage.open(io.BytesIO(data)) as img:
        _, rows, cols = spec.grid.grid(img.height, img.width)
    m = spec.grid.merge_size
    return ImageGrid(start, rows // m, cols // m)
