"""The engine's encoder step for a model that sees (docs/vision.md): a step's requests'
images (`GenerateRequest.images`: each file as the client sent it, its digest, its
placeholders' span) become the rows their `<image>` placeholder tokens take in the text
model's input embeddings. It reads the model's image side through the family's hook only
(`models.vision.ImageSide`: prepare, encode, image_token_id), so any family that sees fits.

- `step_rows` (the engine, before the forward): the step's image rows at their positions in
  the packed step, for the prompt chunks that compute some image's placeholders; a
  request's images are encoded once for its prompt (kept, `release`d when its prompt is
  computed, it is preempted or it leaves), so a chunked prefill that splits an image reads
  the same rows in each chunk; `settle` (after the step) releases what is done.
- `encode`: each image's rows from the encoder cache by its digest under its request's
  root, else from its file (`prepare`), the step's missing images encoded in one batch,
  each kept in the cache. A repeated image in the same step is encoded once. Each image is
  held in the cache for its request until `release`.
- `scatter`: for the prompt positions [first, end) a prefill chunk computes, the
  positions (from `first`) of the `<image>` tokens it holds and their rows, in prompt
  order: `embeds[positions] = rows` is transformers' `inputs_merger` over the chunk.

An image whose placeholders do not hold as many `<image>` tokens as its encoder gives
rows, or whose file does not decode, fails its request (`encode`'s second result,
naming the image), no other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from wsllm.engine.encoder_cache import EncoderCache, key
from wsllm.engine.sequence import Sequence as Seq
from wsllm.models.vision import ImageSide
from wsllm.prompt_image import PromptImage


@dataclass(frozen=True, slots=True)
class ImageWork:
    """A request's images, for one step: its id, its prefix-cache root, its prompt."""

    request_id: str
    root: bytes | None
    prompt_ids: Sequence[int]
    images: Sequence[PromptImage]


class EncoderStep:
    def __init__(self, side: ImageSide, cache: EncoderCache) -> None:
        self.side, self.image_token_id, self.cache = side, side.image_token_id, cache
        self._rows: dict[str, list[torch.Tensor]] = {}  # request -> its images' rows, until release

    def step_rows(
        self, scheduled: list[tuple[Seq, int]], preempted: Sequence[Seq] = ()
    ) -> tuple[list[tuple[Seq, int]], tuple[torch.Tensor, torch.Tensor] | None, list[tuple[Seq, str]]]:
        """The step without the sequences whose images fail (each with why), and its image
        rows: the packed positions ([k], in that step) of the `<image>` tokens its chunks
        compute and the rows they take ([k, hidden]), None when none does. The images of the
        requests not yet encoded are encoded first, in one batch; those of the step's
        `preempted` sequences are let go first (recomputed later: from the cache, or again)."""
        for seq in preempted:
            self.release(seq.request_id)
        chunks = [
            (seq, seq.num_computed_tokens, seq.num_computed_tokens + n) for seq, n in scheduled if seq.images
        ]
        chunks = [
            c for c in chunks if any(im.start < c[2] and c[1] < im.start + im.length for im in c[0].images)
        ]
        need = {seq.request_id: _work(seq) for seq, _, _ in chunks if seq.request_id not in self._rows}
        got, failed = self.encode(list(need.values()))
        self._rows |= got
        kept = [(seq, n) for seq, n in scheduled if seq.request_id not in failed] if failed else scheduled
        bad = [(seq, failed[seq.request_id]) for seq, _ in scheduled if seq.request_id in failed]
        at: list[torch.Tensor] = []
        taken: list[torch.Tensor] = []
        offset = 0  # the chunk's first row in the packed step
        for seq, n in kept:
            rows = self._rows.get(seq.request_id) if seq.images else None
            start = seq.num_computed_tokens
            part = None if rows is None else self.scatter(_work(seq), rows, start, start + n)
            if part is not None:
                at.append(part[0] + offset)
                taken.append(part[1])
            offset += n
        return kept, ((torch.cat(at), torch.cat(taken)) if at else None), bad

    def settle(self, scheduled: Sequence[tuple[Seq, int]]) -> None:
        """After the step: release the requests whose chunks computed their last image (or
        ended: a finished sequence's count is not advanced)."""
        for seq, _ in scheduled:
            if seq.request_id in self._rows and (
                seq.finished or seq.num_computed_tokens >= max(im.start + im.length for im in seq.images)
            ):
                self.release(seq.request_id)

    @property
    def held(self) -> int:
        """Requests whose images' rows are held now (0 when nothing is in flight)."""
        return len(self._rows)

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
        """The encoder over every missing image at once, split back per image; an image
        whose file does not decode is left out, its request in `failed`."""
        prepared: dict[str, object] = {}
        for k, (rid, i, im) in missing.items():
            try:
                prepared[k] = self.side.prepare(im.file())
            except Exception as e:  # a file the gateway checked; a bad entry fails its own request
                failed[rid] = f"request {rid!r}: images.{i} does not decode ({e})"
        if not prepared:
            return {}
        with torch.no_grad():
            parts = dict(zip(prepared, self.side.encode(list(prepared.values())), strict=True))
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
        self._rows.pop(request_id, None)
        self.cache.release(request_id)


def _work(seq: Seq) -> ImageWork:
    return ImageWork(seq.request_id, seq.cache_root, seq.prompt_token_ids, seq.images)
