"""A model that sees, served (docs/vision.md): the official `openai` client sends a tiny
random SmolVLM base64 PNGs in a chat (two images, the first in an earlier turn); the
gateway's prompt is transformers' Idefics3Processor's, the answer HF generate's greedy
tokens in fp32, streamed and whole; the same conversation again reports the image's
blocks as `cached_tokens` and the encoder does not run."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import transformers
from PIL import Image as PILImage
from tiny_vlm import Turns, hf_processor, hf_prompt, hf_tokens, png

from wsllm.config import EngineConfig

MAX_TOKENS = 5
WIDE = png(PILImage.effect_noise((100, 70), 60).convert("RGB"))
TALL = png(PILImage.effect_noise((20, 50), 40).convert("RGB"))
EARLIER: Turns = [
    ("user", [WIDE, "Describe it."]),
    ("assistant", ["A field."]),
    ("user", ["And", TALL, "this?"]),
]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_smolvlm_dir: Path) -> Iterator[Any]:
    from wsllm.engine.engine import LLMEngine

    cfg = EngineConfig(
        model=str(tiny_smolvlm_dir), num_kv_blocks=256, dtype="float32", kv_cache_dtype="float32"
    )
    with live_server(LLMEngine.from_config(cfg)) as s:
        yield s


def _messages(turns: Turns) -> list[dict[str, Any]]:
    def part(p: str | bytes) -> dict[str, Any]:
        if isinstance(p, str):
            return {"type": "text", "text": p}
        return {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()},
        }

    return [{"role": r, "content": [part(p) for p in ps] if r == "user" else "".join(ps)} for r, ps in turns]


def test_the_openai_client_gets_hfs_tokens_for_images_and_the_repeat_is_cached(
    srv: Any, tiny_smolvlm_dir: Path
) -> None:
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(str(tiny_smolvlm_dir)).eval()
    ids, files = hf_prompt(hf_processor(tiny_smolvlm_dir), EARLIER)
    want = hf_tokens(hf, ids, files, MAX_TOKENS)
    c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(
        model=srv.gateway.model_name,
        messages=_messages(EARLIER),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "cache_salt": "vision-api"},
    )
    enc = srv.engine.images
    runs = enc.cache.stats.runs
    whole = c.chat.completions.create(**kw)
    assert whole.prompt_token_ids == ids  # type: ignore[attr-defined]
    assert whole.choices[0].token_ids == want  # type: ignore[attr-defined]
    assert enc.cache.stats.runs - runs == 2 and whole.usage is not None
    first_image = ids.index(hf.config.image_token_id)
    streamed = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert [t for ch in streamed if ch.choices for t in ch.choices[0].token_ids] == want  # type: ignore[attr-defined]
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > first_image + 40  # past the first image's placeholders
    assert enc.cache.stats.runs - runs == 2  # the repeat: prefix hits and the encoder cache, no run
