"""The prompt of a chat for a model that sees (its tokenizer's directory has an image
processor: `TextCodec.tiling`): the messages as HF's processors give them to the chat
template (each content a list of text and image parts), each image the template writes
(SmolVLM's `<image>`, Qwen3-VL's `<|image_pad|>`: `tiling.marker`) replaced by that image's
placeholder tokens, which follow from its size alone (image_tiles.py, image_grid.py), so
the prompt's ids are those of HF's processor for the same images
and text; and where each image's placeholders lie in the final prompt (`placed`), for
the engine and the prefix cache's image keys (docs/vision.md)."""

from __future__ import annotations

import functools
from typing import Any

from wsllm.prefix_hash import ImageSpan
from wsllm.server.conversation import ChatMessage, TextPart
from wsllm.server.errors import APIError
from wsllm.server.images import Image
from wsllm.server.text import TextCodec


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a vision model's chat template reads them: every content a list of
    `{"type": "text", "text": ...}` and `{"type": "image"}` parts, in the client's order."""
    out = []
    for m in messages:
        d = m.as_template_input()
        if isinstance(m.content, list):
            d["content"] = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in m.content
            ]
        else:
            d["content"] = [{"type": "text", "text": m.content or ""}]
        out.append(d)
    return out


def images_of(messages: list[ChatMessage]) -> list[Image]:
    """The conversation's images (checked), in the order the template writes them."""
    return [p.image for m in messages for _, p in m.image_parts]


def encode_chat(codec: TextCodec, messages: list[ChatMessage], template: dict[str, Any]) -> list[int]:
    """A chat's prompt ids with its images' placeholders (`template`: the chat plan's)."""
    # The vision families' templates take tools themselves: no chat style writes them in.
    kw = {k: v for k, v in template.items() if k != "tool_prompt"}
    return codec.encode_chat_images(template_messages(messages), _holders(codec, messages), **kw)[0]


def _holders(codec: TextCodec, messages: list[ChatMessage]) -> list[list[int]]:
    """Each image's placeholder ids, in order; an image the model's processor refuses (a
    Qwen3-VL image more than 200 times as long as it is wide) is a 400 naming its part."""
    out = []
    for i, m in enumerate(messages):
        for j, part in m.image_parts:
            try:
                out.append(list(placeholder_ids(codec, part.image.height, part.image.width)))
            except ValueError as e:
                where = f"messages.{i}.content.{j}"
                raise APIError(400, "invalid_request", f"{where}: {e}", param=where) from None
    return out


@functools.lru_cache(maxsize=256)
def placeholder_ids(codec: TextCodec, height: int, width: int) -> tuple[int, ...]:
    """The placeholder tokens of an image of this size (the tiling's text, its special
    tokens read as such: HF's processor tokenizes it so)."""
    if codec.tiling is None:
        raise ValueError("this model reads text only")
    return tuple(codec.encode(codec.tiling.placeholder(height, width), add_special_tokens=False))


def placed(
    messages: list[ChatMessage], codec: TextCodec, prompt_ids: list[int], max_bytes: int
) -> list[tuple[Image, ImageSpan]]:
    """Each image of the conversation with its placeholders' span in `prompt_ids` (a
    prompt the template wrote, perhaps truncated or given a BOS since). The placeholders
    begin with special tokens no text part can give (a text part is plain text), so the
    first match after the previous image's is the image's. An image the prompt no longer
    holds whole (`truncate_prompt_tokens` cut into it) is a 400, and so are images whose
    files are more than `max_bytes` all told (--max-request-image-bytes: what one
    request carries across the broker)."""
    if codec.tiling is None:
        return []
    out, at = [], 0
    shown = images_of(messages)
    if (total := sum(len(im.data) for im in shown)) > max_bytes:
        why = f"messages: the images have {total} bytes; this server's limit for one request is {max_bytes}"
        raise APIError(400, "invalid_request", why, param="messages")
    for im in shown:
        holder = list(placeholder_ids(codec, im.height, im.width))
        start = _find(prompt_ids, holder, at)
        if start < 0:
            why = "truncate_prompt_tokens: the truncated prompt would cut an image's tokens"
            raise APIError(400, "invalid_request", why, param="truncate_prompt_tokens")
        out.append((im, ImageSpan(start, len(holder), im.digest)))
        at = start + len(holder)
    return out


def _find(ids: list[int], part: list[int], at: int) -> int:
    first, n = part[0], len(part)
    while True:
        try:
            at = ids.index(first, at)
        except ValueError:
            return -1
        if ids[at : at + n] == part:
            return at
        at += 1
