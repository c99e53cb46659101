"""SmolVLM's (Idefics3's) image side: the SigLIP encoder over each tile, then the
connector: a pixel shuffle that folds each `scale x scale` square of patch states into
one (the tile's tokens fall by `scale**2`, their width grows by as much) and a linear
projection into the text model's width. A tile of `image_size` pixels gives
`(image_size / patch_size)**2 / scale**2` tokens, which the prompt's `<image>`
placeholders stand for, in order.

`Idefics3Vision.from_hf` builds it from a checkpoint's config.json; its parameters are
named as HF's `model.vision_model.*` and `model.connector.*` without the `model.`, so
`load_hf` takes a checkpoint's state dict as it is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsllm.models.vision import idefics3_pixels
from wsllm.models.vision.idefics3_pixels import PixelSpec
from wsllm.models.vision.siglip import SiglipConfig, VisionTransformer

#: a checkpoint tensor's prefix -> the module's (the text model's tensors are not ours)
HF_PREFIXES = ("model.vision_model.", "model.connector.")


@dataclass(frozen=True, slots=True)
class Idefics3VisionConfig:
    encoder: SiglipConfig
    scale_factor: int
    text_hidden_size: int
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Idefics3VisionConfig:
        """From an Idefics3 config.json (its `vision_config` and `text_config`)."""
        return cls(
            encoder=SiglipConfig.from_hf(cfg["vision_config"]),
            scale_factor=cfg.get("scale_factor", 2),
            text_hidden_size=cfg["text_config"]["hidden_size"],
            image_token_id=cfg["image_token_id"],
        )

    @property
    def tokens_per_tile(self) -> int:
        return self.encoder.patches_per_side**2 // self.scale_factor**2


class Projection(nn.Module):
    def __init__(self, cfg: Idefics3VisionConfig) -> None:
        super().__init__()
        width = cfg.encoder.hidden_size * cfg.scale_factor**2
        self.proj = nn.Linear(width, cfg.text_hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, cfg: Idefics3VisionConfig) -> None:
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = Projection(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tiles, side * side, d] -> [tiles, side**2 / s**2, d * s**2] -> [.., text hidden]
        t, n, d = x.shape
        side, s = int(n**0.5), self.scale
        # each row's s neighbours side by side, then each column's: HF's order of the folded width
        x = x.view(t, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(t, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(t, n // (s * s), d * s * s))


class Idefics3Vision(nn.Module):
    """Normalized tiles -> the text model's input rows that stand at their placeholders."""

    def __init__(self, cfg: Idefics3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_model = VisionTransformer(cfg.encoder)
        self.connector = Connector(cfg)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Idefics3Vision:
        return cls(Idefics3VisionConfig.from_hf(cfg))

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """The image side's tensors of a checkpoint's state dict (strict: each one present)."""
        ours = {k.removeprefix("model."): v for k, v in state.items() if k.startswith(HF_PREFIXES)}
        self.load_state_dict(ours, strict=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [tiles, 3, image_size, image_size] -> [tiles * tokens_per_tile, text hidden]
        side = self.cfg.encoder.image_size
        if pixels.shape[-2:] != (side, side):
            raise ValueError(f"a tile is {side}x{side} pixels, got {tuple(pixels.shape[-2:])}")
        out = self.connector(self.vision_model(pixels))
        return out.reshape(-1, out.shape[-1])


class Idefics3ImageSide:
    """SmolVLM's `ImageSide` (wsllm/models/vision/__init__.py): tiles from a file, the
    encoder over every tile of the step at once."""

    def __init__(self, vision: Idefics3Vision, spec: PixelSpec) -> None:
        self.vision, self.spec = vision, spec
        self.image_token_id = vision.cfg.image_token_id

    def prepare(self, file: bytes) -> torch.Tensor:  # -> [tiles, 3, tile, tile] fp32
        return idefics3_pixels.tiles(idefics3_pixels.rgb(file), self.spec)

    def encode(self, prepared: list[torch.Tensor]) -> list[torch.Tensor]:
        p = next(self.vision.parameters())
        with torch.no_grad():
            rows = self.vision(torch.cat(prepared).to(p.device, p.dtype))  # [all tiles * per tile, hidden]
        per_tile = self.vision.cfg.tokens_per_tile
        return list(rows.split([t.shape[0] * per_tile for t in prepared]))


def image_side(
    cfg: dict[str, Any],
    model_dir: Path,
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> Idefics3ImageSide | None:
    """A SmolVLM checkpoint's image side on the text model's device and dtype; None when its
    directory has no image processor's config (the gateway then says it cannot see)."""
    pre = model_dir / "preprocessor_config.json"
    if not pre.exists() or not tensors:
        return None
    vision = Idefics3Vision.from_hf(cfg)
    vision.load_hf({k if k.startswith("model.") else "model." + k: v for k, v in tensors.items()})
    vision = vision.to(device, dtype).eval()
    spec = PixelSpec.from_hf(json.loads(pre.read_text()), vision.cfg.tokens_per_tile)
    return Idefics3ImageSide(vision, spec)
