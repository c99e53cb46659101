"""Qwen3-VL's vision tower: an image's patches (qwen3_vl_pixels.py) embedded by a linear map
of each patch (HF's stride-equals-kernel Conv3d), a learned position table resized to the
image's grid (bilinear, corners aligned), 2-D rotary (a head's first half turns by the patch's
row, its second by its column), pre-norm blocks whose attention sees the whole image and no
other, then the patch merger: each `merge x merge` square of patch states folded into one row
of the text model's width. DeepStack: the states after a few of the blocks
(`deepstack_visual_indexes`) are folded by mergers of their own, and those rows are added to
the text model's hidden states at the image's tokens after its first layers.

`forward` gives each of an image's tokens one packed row: its input embedding, then each
deepstack level's row, side by side ([tokens, (1 + levels) * text hidden]): one tensor per
image, as the encoder cache keeps it; `unpack` splits a run of such rows. Parameter names are
HF's `model.visual.*` without the prefix, so `load_hf` takes a checkpoint's state dict as it is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wsllm import kernels

HF_PREFIX = "model.visual."
Grid = tuple[int, int, int]  # (frames, patch rows, patch cols): HF's image_grid_thw


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int  # the text model's width
    num_position_embeddings: int  # a square table: side**2
    deepstack_layers: tuple[int, ...]  # the blocks whose outputs feed the text model's first layers
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> VisionConfig:
        """From an HF Qwen3-VL `vision_config`."""
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision_config.hidden_act {act!r} is not served (Qwen3-VL's is gelu_pytorch_tanh)"
            )
        rope = vision.get("rope_parameters") or {}
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            depth=vision.get("depth", vision.get("num_hidden_layers")),
            num_heads=vision.get("num_heads", vision.get("num_attention_heads")),
            patch_size=vision["patch_size"],
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            merge_size=vision.get("spatial_merge_size", 2),
            out_hidden_size=vision["out_hidden_size"],
            num_position_embeddings=vision["num_position_embeddings"],
            deepstack_layers=tuple(vision.get("deepstack_visual_indexes", ())),
            in_channels=vision.get("in_channels", 3),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        k = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [patches, C * T * P * P] -> [patches, hidden]: the kernel covers the whole patch
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        # x: [patches, hidden]; rope: [patches, head_dim] cos | sin; each image attends to itself
        n = x.shape[0]
        q, k, v = self.qkv.forward(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = q.contiguous(), k.contiguous()
        kernels.rotary_embedding(torch.arange(n, device=x.device), q, k, rope)
        out = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]  # each [heads, patches, head_dim]
        return self.proj.forward(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2.forward(F.gelu(self.linear_fc1.forward(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn.forward(self.norm1.forward(x), rope, lengths)
        return x + self.mlp.forward(self.norm2.forward(x))


class PatchMerger(nn.Module):
    """`merge**2` consecutive patch states -> one row of the text model's width. The main
    merger norms each patch state before it folds them; a deepstack merger norms the fold."""

    def __init__(self, c: VisionConfig, norm_after_fold: bool) -> None:
        super().__init__()
        self.width = c.hidden_size * c.merge_size**2
        self.norm_after_fold = norm_after_fold
        self.norm = nn.LayerNorm(self.width if norm_after_fold else c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [patches, hidden] -> [patches / merge**2, out hidden]
        x = self.norm.forward(x.reshape(-1, self.width) if self.norm_after_fold else x).reshape(
            -1, self.width
        )
        return self.linear_fc2.forward(F.gelu(self.linear_fc1.forward(x)))


class Qwen3VLVision(nn.Module):
    """Patches of images -> each image token's packed row (module docstring)."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.cfg = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings**0.5)
        if self.side**2 != c.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {c.num_position_embeddings} is not a square")
        quarter = torch.arange(0, c.head_dim // 2, 2, dtype=torch.float) / (c.head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / c.rope_theta**quarter, persistent=False)  # [head_dim / 4]
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, norm_after_fold=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(c, True) for _ in c.deepstack_layers)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3VLVision:
        """From a Qwen3-VL config.json (its `vision_config`)."""
        return cls(VisionConfig.from_hf(cfg["vision_config"]))

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """The image side's tensors of a checkpoint's state dict (strict: each one present)."""
        ours = {k.removeprefix(HF_PREFIX): v for k, v in state.items() if k.startswith(HF_PREFIX)}
        self.load_state_dict(ours, strict=True)

    @property
    def levels(self) -> int:
        """The deepstack levels: the text layers that take rows beside the input embedding."""
        return len(self.cfg.deepstack_layers)

    def tokens(self, grid: Grid) -> int:
        t, rows, cols = grid
        return t * rows * cols // self.cfg.merge_size**2

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        # pixels: [sum of patches, patch_dim], images one after the other (qwen3_vl_pixels.patches)
        # -> [sum of tokens, (1 + levels) * out hidden], packed rows (module docstring)
        c = self.cfg
        counts = [t * h * w for t, h, w in grids]
        if pixels.shape != (sum(counts), c.patch_dim):
            raise ValueError(
                f"patches {tuple(pixels.shape)} for grids {list(grids)}: [{sum(counts)}, {c.patch_dim}]"
            )
        x = self.patch_embed.forward(pixels)
        x = x + torch.cat([self._positions(g) for g in grids]).to(x.dtype)
        rope = torch.cat([self._rotary(g, x.device) for g in grids])
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # a frame attends to itself
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block.forward(x, rope, lengths)
            if i in c.deepstack_layers:
                merger = self.deepstack_merger_list[c.deepstack_layers.index(i)]
                stacked.append(merger.forward(x))
        return torch.cat([self.merger.forward(x), *stacked], dim=-1)

    def encode(self, images: Sequence[tuple[torch.Tensor, Grid]]) -> list[torch.Tensor]:
        """Several images' (patches, grid) (qwen3_vl_pixels.prepare) in one batch -> each
        image's packed rows [tokens, (1 + levels) * H]: what the encoder step caches."""
        grids = [g for _, g in images]
        with torch.no_grad():
            rows = self.forward(torch.cat([p for p, _ in images]), grids)
        return list(rows.split([self.tokens(g) for g in grids]))

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Packed rows [n, (1 + levels) * H] -> the input embeddings [n, H] and each
        deepstack level's rows [n, H], in layer order."""
        parts = rows.split(self.cfg.out_hidden_size, dim=-1)
        return parts[0], list(parts[1:])

    def _merge_order(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols, ...] grid's cells in the order the merger folds them: each
        merge x merge square's cells together, row by row, the squares row by row."""
        m = self.cfg.merge_size
        x = x.reshape(rows // m, m, cols // m, m, *x.shape[2:]).transpose(1, 2)
        return x.reshape(rows * cols, *x.shape[4:])

    def _positions(self, grid: Grid) -> torch.Tensor:
        """The learned position table, resized to the grid (bilinear, corners aligned)."""
        t, rows, cols = grid
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=True)[0]
        return self._merge_order(resized.permute(1, 2, 0), rows, cols).repeat(t, 1)  # [t * rows * cols, d]

    def _rotary(self, grid: Grid, device: torch.device) -> torch.Tensor:
        """Each patch's rotary row [patches, head_dim]: cos | sin of (row * f, col * f)."""
        t, rows, cols = grid
        r = torch.arange(rows, device=device)[:, None].expand(rows, cols)
        k = torch.arange(cols, device=device)[None, :].expand(rows, cols)
        at = self._merge_order(torch.stack([r, k], dim=-1), rows, cols).float()  # [patches, 2]
        angles = (at[:, :, None] * self.inv_freq.to(device)).reshape(len(at), -1)  # rows' then cols'
        return torch.cat([angles.cos(), angles.sin()], dim=-1).repeat(t, 1)
