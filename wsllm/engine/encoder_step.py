"""The engine's encoder step for a model that sees (docs/vision.md), not yet wired into
the model runner: a step's requests' images (`GenerateRequest.images`: each file as the
client sent it, its digest, its placeholders' span) become the rows their `<image>`
placeholder tokens take in the text model's input embeddings.

- `encode`: each image's rows from the encoder cache by its digest under its request's
  root, else from its file: decoded and cut into tiles (`PixelSpec`), the step's missing
  images encoded in one batch of tiles, each kept in the cache. A repeated image in the
  same step is encoded once. Each image is held in the cache for its request until
  `release` (a chunked prefill may split its placeholders over steps).
- `scatter`: for the prompt positions [first, end) a prefill chunk computes, the
  positions (from `first`) of the `<image>` tokens it holds and their rows, in prompt
  order: `embeds[positions] = rows` is transformers' `inputs_merger` over the chunk.

An image whose placeholders do not hold as many `<image>` tokens as its encoder gives
rows, or whose file does not decode, fails its request (`encode`'s second result,
naming the image), no other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from wsllm.engine.encoder_cache import EncoderCache, key
from wsllm.models.vision import idefics3_pixels
from wsllm.models.vision.idefics3_pixels import PixelSpec
from wsllm.prompt_image import PromptImage


@dataclass(frozen=True, slots=True)
class ImageWork:
    """A request's images, for one step: its id, its prefix-cache root, its prompt."""

    request_id: str
    root: bytes | None
    prompt_ids: Sequence[int]
    images: Sequence[PromptImage]


class EncoderStep:
    def __init__(
        self,
        encoder: Callable[[torch.Tensor], torch.Tensor],  # tiles -> rows (Idefics3Vision)
        spec: PixelSpec,
        image_token_id: int,
        cache: EncoderCache,
    ) -> None:
        self.encoder, self.spec, self.image_token_id, self.cache = encoder, spec, image_token_id, cache

    def encode(self, work: Sequence[ImageWork]) -> tuple[dict[str, list[torch.Tensor]], dict[str, str]]:
        """Each request's images' rows, in its images' order (by request id), and the
        requests that fail, each with why (its images released): a file that does not
        decode, placeholders that do not match its rows. The others are unaffected."""
        keys = {w.request_id: [key(w.root, im.digest) for im in w.images] for w in work}
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, tuple[str, int, PromptImage]] = {}  # entry -> (request, index, image)
        for w in work:
            for i, (k, im) in enumerate(zip(keys[w.request_id], w.images, strict=True)):
                self.cache.hold(k, w.request_id)
                if k in found or k in missing:
                    continue
                rows = self.cache.get(k)
                if rows is None:
                    missing[k] = (w.request_id, i, im)
                else:
                    found[k] = rows
        failed: dict[str, str] = {}
        found |= self._run(missing, failed)
        out: dict[str, list[torch.Tensor]] = {}
        for w in work:
            rid = w.request_id
            if any(k not in found for k in keys[rid]):
                failed.setdefault(rid, f"request {rid!r}: an image of it does not decode")
            else:
                out[rid] = [found[k] for k in keys[rid]]
                why = next(filter(None, (self._mismatch(w, i, r) for i, r in enumerate(out[rid]))), None)
                if why is not None:
                    failed[rid] = why
                    del out[rid]
        for rid in failed:
            self.cache.release(rid)
        return out, failed

    def _run(
        self, missing: dict[str, tuple[str, int, PromptImage]], failed: dict[str, str]
    ) -> dict[str, torch.Tensor]:
        """The encoder over every missing image's tiles at once, split back per image; an
        image whose file does not decode is left out, its request in `failed`."""
        tiles: dict[str, torch.Tensor] = {}
        for k, (rid, i, im) in missing.items():
            try:
                tiles[k] = idefics3_pixels.tiles(idefics3_pixels.rgb(im.file()), self.spec)
            except Exception as e:  # a file the gateway checked; a bad entry fails its own request
                failed[rid] = f"request {rid!r}: images.{i} does not decode ({e})"
        if not tiles:
            return {}
        with torch.no_grad():
            rows = self.encoder(torch.cat(list(tiles.values())))
        per_tile = rows.shape[0] // sum(t.shape[0] for t in tiles.values())
        parts = dict(zip(tiles, rows.split([t.shape[0] * per_tile for t in tiles.values()]), strict=True))
        for k, part in parts.items():
            self.cache.put(k, part)
        return parts

    def _mismatch(self, w: ImageWork, i: int, rows: torch.Tensor) -> str | None:
        im = w.images[i]
        span = w.prompt_ids[im.start : im.start + im.length]
        holes = sum(1 for t in span if t == self.image_token_id)
        if holes == rows.shape[0]:
            return None
        return (
            f"request {w.request_id!r}: images.{i} has {holes} image tokens in its span "
            f"for {rows.shape[0]} rows of its encoder"
        )

    def scatter(
        self, w: ImageWork, rows: Sequence[torch.Tensor], first: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positions (from `first`) of the `<image>` tokens in prompt positions
        [first, end) and the rows they take; None when the chunk holds none."""
        at: list[int] = []
        taken: list[torch.Tensor] = []
        for im, r in zip(w.images, rows, strict=True):
            lo, hi = max(first, im.start), min(end, im.start + im.length)
            if lo >= hi:
                continue
            span = torch.as_tensor(w.prompt_ids[im.start : im.start + im.length])
            holes = (span == self.image_token_id).nonzero().flatten()  # offsets in the span
            inside = (holes >= lo - im.start) & (holes < hi - im.start)
            at += (holes[inside] + im.start - first).tolist()
            taken.append(r[inside.nonzero().flatten()])
        if not at:
            return None
        return torch.tensor(at, dtype=torch.long), torch.cat(taken)

    def release(self, request_id: str) -> None:
        """Its prompt is computed (or it left): its images may leave the cache again."""
        self.cache.release(request_id)
