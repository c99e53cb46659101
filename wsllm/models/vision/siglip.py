"""SigLIP's vision transformer as SmolVLM (Idefics3) runs it: square tiles cut into
patches by a strided convolution, a learned position per patch, pre-norm encoder layers
with bidirectional attention and a tanh-GELU MLP, and a last LayerNorm.

Parameter names are HF's (`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`,
`post_layernorm`, ...), so a checkpoint's `model.vision_model.*` tensors load as they are.
Positions follow HF's rule for a tile of any patch grid (NaViT's fractional buckets), so
a tile smaller than the encoder's image size reads the positions HF gives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tile's side in pixels
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> SiglipConfig:
        """From an HF `vision_config` (Idefics3VisionConfig's fields)."""
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision_config.hidden_act {act!r} is not served (SigLIP's is gelu_pytorch_tanh)"
            )
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.side = cfg.patches_per_side
        self.patch_size = cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.side**2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [tiles, channels, H, W] -> [tiles, (H / patch) * (W / patch), hidden]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        rows, cols = pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        return x + self.position_embedding(self._positions(rows, cols, pixels.device))

    def _positions(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """Each patch's position: its fractional place in the tile, bucketed into the
        encoder's grid (HF's arithmetic, float32, so that a bucket edge falls the same way)."""
        n = self.side
        edges = torch.arange(1 / n, 1.0, 1 / n, device=device)
        h = torch.arange(rows, device=device, dtype=torch.float32) * (1.0 / torch.tensor(float(rows)))
        w = torch.arange(cols, device=device, dtype=torch.float32) * (1.0 / torch.tensor(float(cols)))
        bh = torch.bucketize(h.clamp(max=1.0 - 1e-6), edges, right=True)
        bw = torch.bucketize(w.clamp(max=1.0 - 1e-6), edges, right=True)
        return (bh[:, None] * n + bw[None, :]).reshape(-1)  # [rows * cols]


class Attention(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, d // cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tiles, patches, hidden]; every patch of a tile sees every other (no mask)
        t, p, _ = x.shape
        q, k, v = (f(x).view(t, p, self.num_heads, self.head_dim).transpose(1, 2) for f in self.qkv)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(t, p, -1))

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj


class MLP(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionTransformer(nn.Module):
    """Tiles -> one hidden state per patch."""

    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [tiles, channels, H, W], normalized -> [tiles, patches, hidden]
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
