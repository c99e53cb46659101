"""`/v1/embeddings`' answer: each input's vector normalized (L2), truncated by
`dimensions` and normalized again (Matryoshka-style), as float or base64 (little-endian
float32), with `usage`.

The decoder-only chat models served here were not trained for `dimensions`, so a
truncated vector keeps less of the text than a whole one: it is the client's choice. A
`dimensions` beyond the model's own size is a 400."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from wsllm.server.fields import invalid


def shaped(vector: list[float], dimensions: int | None) -> bytes:
    """The first `dimensions` values (all when None), L2-normalized, as little-endian
    float32: the one form both encodings are read from, so that they agree exactly."""
    v = vector if dimensions is None else vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in v))
    scale = 1.0 / norm if norm > 0 else 1.0  # an all-zero vector stays as it is
    return struct.pack(f"<{len(v)}f", *(x * scale for x in v))


def _encoded(packed: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(packed).decode("ascii")
    return list(struct.unpack(f"<{len(packed) // 4}f", packed))


def answer(
    vectors: list[list[float]], dimensions: int | None, encoding_format: str, model: str, tokens: int
) -> dict[str, Any]:
    """The answer's body; a 400 for `dimensions` past the vectors' size."""
    size = len(vectors[0])
    if dimensions is not None and dimensions > size:
        raise invalid("dimensions", f"must be at most {size}, the size of {model}'s embeddings")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(shaped(v, dimensions), encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
