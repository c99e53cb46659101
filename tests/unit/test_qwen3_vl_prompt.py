"""The gateway's side of Qwen3-VL (wsllm/image_grid.py, no torch): an image's placeholder count
from its size is HF's image processor's for the checkpoints' own settings, a tokenizer
directory with a Qwen2-VL image processor is a model that sees, and the chat prompt the
gateway writes for images and text is token for token Qwen3VLProcessor's."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import transformers
from PIL import Image as PILImage
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from wsllm.image_grid import IMAGE_PAD, VISION_END, VISION_START, VisionGrid

# Qwen3-VL-2B-Instruct's preprocessor_config.json, and an older Qwen2-VL's spelling
QWEN3_VL = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN2_VL = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}


@pytest.mark.parametrize("pre", [QWEN3_VL, QWEN2_VL], ids=["qwen3-vl", "qwen2-vl"])
@pytest.mark.parametrize("size", [(512, 512), (1000, 333), (7, 900), (5000, 4000)])
def test_the_token_count_is_hfs_for_the_checkpoints_settings(
    pre: dict[str, Any], size: tuple[int, int]
) -> None:
    """Square, wide, tall and past max_pixels: HF's patches for that size / merge**2."""
    kw = {k: v for k, v in pre.items() if k != "image_processor_type"}
    hf = Qwen2VLImageProcessorPil(**kw)
    height, width = size
    grid = VisionGrid.from_hf(pre)
    assert grid.num_tokens(height, width) == hf.get_number_of_image_patches(height, width, {}) // 4
    assert grid.placeholder(height, width) == IMAGE_PAD * grid.num_tokens(height, width)


# Qwen3-VL's chat template, cut down: an image part is the start, one pad, the end
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PRE = {
    "patch_size": 8,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 1024, "longest_edge": 8192},
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A Qwen3-VL-style tokenizer directory: SmolLM2's tokenizer with Qwen's vision tokens,
    the chat template and the image processor's config."""
    out = tmp_path_factory.mktemp("qwen-vl")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(smollm_dir))
    tok.add_special_tokens(
        {"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, "<|video_pad|>"]}
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps(PRE))
    return out


def _png(img: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def test_the_gateways_prompt_of_images_is_qwen3vl_processors(
    vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two images with text around them and a system turn: the prompt ids are
    Qwen3VLProcessor's for the same images and text, each image's span its pads between
    the template's vision start and end; a pad typed in a text part stays text; an image
    the processor refuses (over 200:1) is a 400 naming its part."""
    from wsllm.config_gateway import GatewayConfig
    from wsllm.server.errors import APIError
    from wsllm.server.models import ServedModel
    from wsllm.server.prepare import prepare
    from wsllm.server.resume import Api
    from wsllm.server.schemas import ChatRequest, validate_http
    from wsllm.server.text import TextCodec

    wide = PILImage.effect_noise((100, 70), 60).convert("RGB")
    tall = PILImage.new("RGB", (20, 50), (9, 80, 3))
    model = ServedModel("qwen-vl", TextCodec(str(vlm_dir)), svc=None)  # type: ignore[arg-type]
    assert model.sees_images and model.codec.tiling == VisionGrid(8, 2, 2, 1024, 8192)

    def ours(between: str, first: PILImage.Image = wide) -> Any:
        url = lambda im: "data:image/png;base64," + base64.b64encode(_png(im)).decode()  # noqa: E731
        parts = [
            {"type": "text", "text": "What is in"},
            {"type": "image_url", "image_url": {"url": url(first)}},
            {"type": "text", "text": between},
            {"type": "image_url", "image_url": {"url": url(tall)}},
        ]
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]}
        cfg = GatewayConfig()
        return asyncio.run(
            prepare(validate_http(ChatRequest, orjson.dumps(body), cfg), Api.CHAT, model, 4096, cfg)
        )

    got = ours(" and here?")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(vlm_dir))
    # no torchvision here, so no video processor: the processor's check of it is skipped
    monkeypatch.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *a: None)
    hf = transformers.Qwen3VLProcessor(Qwen2VLImageProcessorPil(**PRE), tok, None, chat_template=TEMPLATE)
    hf_parts = [{"type": "text", "text": "What is in"}, {"type": "image"}]
    hf_parts += [{"type": "text", "text": " and here?"}, {"type": "image"}]
    hf_msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": hf_parts},
    ]
    text = tok.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True)
    assert got.prompt_ids == hf(text=[text], images=[wide, tall])["input_ids"][0]
    pad, start, end = (model.codec.token_id(t) for t in (IMAGE_PAD, VISION_START, VISION_END))
    for (_, span), n in zip(got.images, (8 * 12 // 4, 8 * 4 // 4), strict=True):  # grids 8x12, 8x4
        assert span.length == n and got.prompt_ids[span.start : span.start + n] == [pad] * n
        assert (got.prompt_ids[span.start - 1], got.prompt_ids[span.start + n]) == (start, end)
    typed = ours(f" and {IMAGE_PAD} here?")  # a special token's text typed by the client
    assert typed.prompt_ids.count(pad) == got.prompt_ids.count(pad)
    assert [s.length for _, s in typed.images] == [s.length for _, s in got.images]
    with pytest.raises(APIError, match=r"messages.1.content.1: the image's aspect ratio 402x2") as e:
        ours(" and here?", PILImage.new("RGB", (402, 2)))
    assert e.value.status == 400 and e.value.param == "messages.1.content.1"
