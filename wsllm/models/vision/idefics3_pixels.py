"""SmolVLM's (Idefics3's) image preprocessing in the engine: an image file as the
encoder's tiles, cut as `wsllm.image_tiles.Tiling` says (the gateway wrote the same
grid's placeholders into the prompt). The pixels are transformers' exactly: Pillow's
LANCZOS at each resize of the 8-bit image, then rescaled and normalized in float32, so
the encoder sees what HF's processor would give it."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image as PILImage

from wsllm.image_tiles import Tiling


@dataclass(frozen=True, slots=True)
class PixelSpec:
    tiling: Tiling
    mean: tuple[float, ...]  # per channel
    std: tuple[float, ...]
    rescale: float = 1 / 255

    @classmethod
    def from_hf(cls, preprocessor: dict[str, Any], tokens_per_tile: int) -> PixelSpec:
        resample = preprocessor.get("resample", 1)
        if resample != PILImage.Resampling.LANCZOS:
            raise ValueError(f"preprocessor resample {resample} is not served (Idefics3's is LANCZOS, 1)")
        return cls(
            Tiling.from_hf(preprocessor, tokens_per_tile),
            tuple(preprocessor.get("image_mean", (0.5, 0.5, 0.5))),
            tuple(preprocessor.get("image_std", (0.5, 0.5, 0.5))),
            preprocessor.get("rescale_factor", 1 / 255),
        )


def rgb(data: bytes) -> PILImage.Image:
    """An image file (checked by the gateway) as RGB, transparency over white."""
    with PILImage.open(io.BytesIO(data)) as img:
        img.seek(0)
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
            return PILImage.alpha_composite(white, rgba).convert("RGB")
        return img.convert("RGB")


def tiles(image: PILImage.Image, spec: PixelSpec) -> torch.Tensor:
    """The encoder's tiles of one image, in the placeholders' order (row by row, then the
    global view): [tiles, 3, tile, tile], float32."""
    t = spec.tiling
    h, w = t.resized(image.height, image.width)
    image = image.resize((w, h), PILImage.Resampling.LANCZOS)
    h, w = t.encoder_size(h, w)
    image = image.resize((w, h), PILImage.Resampling.LANCZOS)
    if h > t.tile or w > t.tile:
        crops = [
            image.crop((x, y, x + t.tile, y + t.tile))
            for y in range(0, h, t.tile)
            for x in range(0, w, t.tile)
        ]
        views = [*crops, image.resize((t.tile, t.tile), PILImage.Resampling.LANCZOS)]
    else:
        views = [image]
    arr = np.stack([np.asarray(v, dtype=np.uint8).transpose(2, 0, 1) for v in views])  # [tiles, 3, t, t]
    x = (arr.astype(np.float64) * spec.rescale).astype(np.float32)
    mean = np.asarray(spec.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.std, dtype=np.float32)[:, None, None]
    return torch.from_numpy((x - mean) / std)
