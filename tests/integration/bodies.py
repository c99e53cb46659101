"""Request bodies the integration tests send, declared once."""

from __future__ import annotations

from typing import Any


def completion(prompt: list[int], n_tokens: int, **kw: Any) -> dict[str, Any]:
    """A /v1/completions body (or a WebSocket completion's fields) over token ids: greedy
    unless `kw` says otherwise, and exactly `n_tokens` long (EOS ignored), so that its
    text and length are known before it runs."""
    return {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True} | kw
