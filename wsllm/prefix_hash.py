"""The prefix cache's hash chain, shared by the engine's block manager (which keys its
cached KV blocks by it) and the broker's prefix-aware routing (which computes a
prompt's keys to find the engine holding the longest cached prefix). One function,
so that the two can never disagree. No torch.

A chain starts from a root: `cache_root(namespace)` for a request that must not share
cached blocks with others (another tenant's salt, another LoRA adapter: the same tokens
under another namespace are other KV), or the common root (None) for everyone else. A
request's root is `request_root(request)`, for the engine worker and for routing alike.

An image's placeholder tokens are the same ids whatever the image, so a block that holds
any of them is keyed by the image too (`ImageSpan`, `image_extras`): by the image's
digest (its pixels' SHA-256, server/images.py) and the offset into the image at which
the block starts (vLLM's rule), mixed into that block's key only. A block of text alone
keeps the key it always had; a different image with the same text misses, and the root
keeps one tenant's image from another's hit."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from wsllm.types import GenerateRequest

#: bytes of a block key an engine publishes for routing (a 1 in 2^64 clash costs one miss)
SUMMARY_BYTES = 8


class ImageSpan(NamedTuple):
    """An image's placeholder tokens in a prompt: `length` of them from `start`."""

    start: int
    length: int
    digest: str  # the image's pixels' SHA-256, hex


def block_key(parent: bytes | None, token_ids: Sequence[int], extras: Sequence[str] = ()) -> bytes:
    """The key of a full KV block: SHA-256 over its parent's key and its token ids, and
    the images its tokens stand for (`image_extras`; none: the key of text alone)."""
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(b"|".join(str(t).encode() for t in token_ids))
    if extras:
        h.update(b"|images|" + "|".join(extras).encode())
    return h.digest()


def nth_key(
    parent: bytes | None, token_ids: Sequence[int], i: int, block_size: int, images: Sequence[ImageSpan] = ()
) -> bytes:
    """The key of a prompt's block `i` (its tokens, its images' parts) after its parent's."""
    first, end = i * block_size, (i + 1) * block_size
    return block_key(parent, token_ids[first:end], image_extras(images, first, end))


def image_extras(images: Sequence[ImageSpan], first: int, end: int) -> tuple[str, ...]:
    """What the block of positions [first, end) adds to its key: each image whose
    placeholders it holds, as `digest@offset` (the offset into the image at which the
    block's part of it starts)."""
    if not images:
        return ()
    return tuple(
        f"{im.digest}@{max(first, im.start) - im.start}"
        for im in images
        if im.start < end and first < im.start + im.length
    )


def cache_root(*namespace: str) -> bytes | None:
    """The root of the chains of a cache namespace (its parts: a tenant's salt, an adapter's
    name; empty parts are left out); None, the common root, when every part is empty."""
    parts = [p for p in namespace if p]
    if not parts:
        return None
    return hashlib.sha256(b"namespace|" + "|".join(parts).encode()).digest()


def request_root(request: GenerateRequest) -> bytes | None:
    """The root of a request's chains: its namespace's (`GenerateRequest.cache_salt`: its
    tenant's salt and its own). The engine worker files its blocks under it and prefix
    routing looks them up under it: one function, so that the two agree."""
    return cache_root(request.cache_salt)


def request_images(request: GenerateRequest) -> tuple[ImageSpan, ...]:
    """Where a request's images' placeholders are in its prompt, as its blocks' keys name
    them: for the engine worker and for routing alike (see `request_root`)."""
    return tuple(ImageSpan(im.start, im.length, im.digest) for im in request.images or ())


def prompt_keys(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes | None = None,
    images: Sequence[ImageSpan] = (),
) -> list[bytes]:
    """The chain keys of the prompt's blocks an engine could take from its cache: the
    full blocks, leaving at least one token to compute (as `BlockManager` matches);
    `images`: where the prompt's images' placeholders are."""
    keys: list[bytes] = []
    parent = root
    for i in range((len(token_ids) - 1) // block_size):
        parent = nth_key(parent, token_ids, i, block_size, images)
        keys.append(parent)
    return keys
