"""The image encoders and projectors of vision families (docs/vision.md), and the one hook a
family that sees gives the engine (`ImageSide`).

The hook: a family's `Family.vision` builds an `ImageSide` from its checkpoint (its config,
its directory's preprocessor config, its image-side tensors). The engine's encoder step
(engine/encoder_step.py) calls nothing else of it:
- `prepare(file)`: one image's file -> whatever the family's encoder reads for it (SmolVLM:
  its normalized tiles), on the host; a file that does not decode raises, failing its request;
- `encode(prepared)`: the step's images, one batch -> each image's rows, [tokens, width] on
  the model's device and dtype: the rows its placeholders take in the text model's input
  embeddings, in order, as many as its span holds `image_token_id` tokens;
- `image_token_id`: the placeholder token those rows replace.
The text model takes the rows at the placeholders' positions (`CausalLM.forward`'s
`image_rows`). A second family (Qwen3-VL: its ViT, its grid of patches) implements the same
three; what it adds beyond rows at placeholders (multimodal rotary positions, features fed to
early layers) is its own, passed beside them."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ImageSide(Protocol):
    image_token_id: int

    def prepare(self, file: bytes) -> Any:
        """One image's file -> its encoder input (host work; raises on a file that does not decode)."""
        ...

    def encode(self, prepared: list[Any]) -> list[torch.Tensor]:
        """The step's images in one batch -> each one's rows [tokens, text hidden]."""
        ...
