"""An image of a prompt as it crosses the broker to an engine (`PromptImage`, in
`GenerateRequest.images`): its file as the client sent it, its pixels' digest and its
placeholder tokens' span. The compressed file crosses, not the preprocessed tiles
(docs/vision.md says why); every field is checked on construction, so a bad entry names
its field and costs its own request only. Imports nothing of wsllm but its bounds."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from wsllm.bounds import MAX_PROMPT_TOKENS, MAX_WIRE_IMAGE_BYTES, STRICT_DECODING, check, is_int

_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True)
class PromptImage:
    """An image of a prompt on its way to an engine (docs/vision.md): its file as the
    client sent it (base64: JSON carries no bytes; the engine decodes and cuts it), its
    pixels' digest (the gateway's `Image.digest`: the encoder cache's and the prefix
    keys'), and its placeholder tokens' span in the prompt."""

    __pydantic_config__ = STRICT_DECODING

    data: str  # the file, base64
    digest: str  # SHA-256 of its RGB pixels and size, 64 lowercase hex digits
    start: int  # its first placeholder token's position in the prompt
    length: int  # its placeholder tokens

    @classmethod
    def of(cls, raw: bytes, digest: str, start: int, length: int) -> PromptImage:
        return cls(base64.b64encode(raw).decode("ascii"), digest, start, length)

    def file(self) -> bytes:
        """The image's file as the client sent it."""
        return base64.b64decode(self.data, validate=True)

    @property
    def file_bytes(self) -> int:
        """The size of its file (from the base64's length, without decoding it)."""
        return len(self.data) // 4 * 3 - self.data[-2:].count("=")

    def __post_init__(self) -> None:
        shown = f"{len(self.data)} characters" if isinstance(self.data, str) else type(self.data).__name__
        ok = isinstance(self.data, str) and 0 < len(self.data) <= MAX_WIRE_IMAGE_BYTES * 4 // 3 + 4
        check(ok and len(self.data) % 4 == 0, "data", "an image file in base64", shown)
        try:
            base64.b64decode(self.data[:64], validate=True)  # its alphabet; decoded whole by the engine
        except (binascii.Error, ValueError):
            check(False, "data", "an image file in base64", shown)
        check(
            isinstance(self.digest, str) and bool(_DIGEST.fullmatch(self.digest)),
            "digest",
            "64 hex digits",
            self.digest,
        )
        for name, least in (("start", 0), ("length", 1)):
            v = getattr(self, name)
            check(
                is_int(v) and least <= v <= MAX_PROMPT_TOKENS,
                name,
                f"an integer in [{least}, {MAX_PROMPT_TOKENS}]",
                v,
            )
