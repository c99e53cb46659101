"""SmolVLM's image side (wsllm/models/vision/, wsllm/image_tiles.py): the SigLIP encoder
and the pixel-shuffle connector over a tiny random-weight Idefics3 that transformers
builds, loaded from its state dict, give HF's image features (`get_image_features`) in
fp32; an image's tiles are HF's image processor's pixel for pixel, and the placeholder
text the gateway writes for it is HF's processor's."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from PIL import Image as PILImage
from tiny_vlm import SMOLVLM_TEMPLATE as TEMPLATE

from wsllm.broker.base import TOKENIZER_FILES
from wsllm.image_tiles import AROUND, GLOBAL, IMAGE, Tiling
from wsllm.models.vision import idefics3_pixels
from wsllm.models.vision.idefics3 import Idefics3ImageSide, Idefics3Vision
from wsllm.models.vision.idefics3_pixels import PixelSpec

TINY = {
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    },
    "text_config": {
        "model_type": "llama",
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
    },
    "scale_factor": 2,
    "image_token_id": 299,
}


@pytest.fixture(scope="module")
def models() -> tuple[Any, Idefics3Vision]:
    torch.manual_seed(0)
    hf = transformers.Idefics3ForConditionalGeneration(transformers.Idefics3Config(**TINY)).eval()
    ours = Idefics3Vision.from_hf(hf.config.to_dict())
    ours.load_hf(hf.state_dict())
    return hf, ours.eval()


def test_the_image_features_are_hfs(models: tuple[Any, Idefics3Vision]) -> None:
    hf, ours = models
    assert ours.cfg.tokens_per_tile == 4  # (32 / 8)**2 patches folded 2 x 2
    tiles = torch.randn(3, 3, 32, 32)  # three tiles of one image, normalized
    with torch.no_grad():
        want = hf.model.get_image_features(tiles[None]).pooler_output[0]
        got = ours(tiles)
    assert got.shape == (3 * 4, 48)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a tile's features do not depend on the tiles beside it
        torch.testing.assert_close(ours(tiles[1:2]), got[4:8], rtol=1e-5, atol=1e-5)


def test_a_tile_of_another_size_is_refused(models: tuple[Any, Idefics3Vision]) -> None:
    with pytest.raises(ValueError, match="a tile is 32x32 pixels"):
        models[1](torch.zeros(1, 3, 16, 32))


PRE = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}, "resample": 1}
ONE = PRE | {"size": {"longest_edge": 32}}  # resized to one tile: no grid, no global view


def _png(img: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    ("pre", "size"), [(PRE, (100, 70)), (PRE, (20, 50)), (ONE, (30, 20))], ids=["wide", "tall", "one-tile"]
)
def test_the_tiles_are_hfs_image_processors(pre: dict[str, Any], size: tuple[int, int]) -> None:
    """Tiles cut as the gateway counted them, pixel for pixel those of transformers'
    Idefics3 image processor (its PIL backend: Pillow's LANCZOS)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    image = PILImage.effect_noise(size, 60).convert("RGB")
    hf = Idefics3ImageProcessorPil(**pre)(image, return_row_col_info=True, return_tensors="pt")
    spec = PixelSpec.from_hf(pre, tokens_per_tile=4)
    got = idefics3_pixels.tiles(idefics3_pixels.rgb(_png(image)), spec)
    assert spec.tiling.grid(image.height, image.width) == (int(hf["rows"][0][0]), int(hf["cols"][0][0]))
    assert got.shape[0] == spec.tiling.num_tiles(image.height, image.width)
    torch.testing.assert_close(got, hf["pixel_values"][0], rtol=0, atol=0)


@pytest.mark.parametrize(("pre", "rows", "cols"), [(ONE, 0, 0), (PRE, 2, 3)])
def test_the_placeholder_text_is_the_processors(pre: dict[str, Any], rows: int, cols: int) -> None:
    me = SimpleNamespace(fake_image_token=AROUND, global_image_tag=GLOBAL, image_token=IMAGE, image_seq_len=4)
    want = transformers.Idefics3Processor.replace_image_token(me, {"rows": [[rows]], "cols": [[cols]]}, 0)
    tiling = Tiling.from_hf(pre, tokens_per_tile=4)
    height, width = (30, 30) if not rows else (32 * rows, 32 * cols)  # sizes that cut into that grid
    assert tiling.grid(height, width) == (rows, cols)
    assert tiling.placeholder(height, width) == want


def test_a_smolvlm_checkpoint_serves_its_text_as_hf_generates(tmp_path: Path, smollm_dir: Path) -> None:
    """The family's registry entry: the text model of an Idefics3 checkpoint loads (its
    image side's tensors left to it) and gives HF's greedy tokens on a text prompt."""
    from wsllm.llm import LLM
    from wsllm.types import SamplingParams

    torch.manual_seed(1)
    hf = transformers.Idefics3ForConditionalGeneration(transformers.Idefics3Config(**TINY)).eval()
    with torch.no_grad():  # larger weights than the default init give peaked, varied logits
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    hf.save_pretrained(str(tmp_path))
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).exists():
            shutil.copy(smollm_dir / name, tmp_path / name)
    llm = LLM(model=str(tmp_path), kv_cache_gb=0.01, dtype="float32", kv_cache_dtype="float32")
    prompt = [5, 77, 3, 250, 18, 9]
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert got.token_ids == want[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A SmolVLM-style tokenizer directory: SmolLM2's tokenizer with Idefics3's special
    tokens, the chat template, and the processor's configs (image_seq_len 4)."""
    import json

    out = tmp_path_factory.mktemp("vlm")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(smollm_dir))
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 4) for c in range(1, 4)]
    tok.add_special_tokens(
        {"additional_special_tokens": [AROUND, IMAGE, GLOBAL, "<end_of_utterance>", *grid]}
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(
        json.dumps(PRE | {"image_processor_type": "Idefics3ImageProcessor"})
    )
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    return out


def test_the_gateways_prompt_of_images_is_hfs_processors(vlm_dir: Path) -> None:
    """For a model that sees, the gateway writes each image's placeholders into the chat
    prompt: token for token what transformers' Idefics3Processor gives for the same images
    and text (two images, text around them, a system turn), each image's span found; an
    `<image>` typed in a text part stays text."""
    import asyncio
    import base64

    import orjson

    from wsllm.config_gateway import GatewayConfig
    from wsllm.server.errors import APIError
    from wsllm.server.models import ServedModel
    from wsllm.server.prepare import prepare
    from wsllm.server.resume import Api
    from wsllm.server.schemas import ChatRequest, validate_http
    from wsllm.server.text import TextCodec
    from wsllm.types import GenerateRequest, PromptImage
    from wsllm.wire import decode_request, encode

    wide, tall = (
        PILImage.effect_noise((100, 70), 60).convert("RGB"),
        PILImage.new("RGB", (20, 50), (9, 80, 3)),
    )
    url = lambda im: "data:image/png;base64," + base64.b64encode(_png(im)).decode()  # noqa: E731
    cfg = GatewayConfig()
    model = ServedModel("vlm", TextCodec(str(vlm_dir)), svc=None)  # type: ignore[arg-type]
    assert model.sees_images and model.codec.tiling == Tiling(96, 32, 4)

    def ours(between: str, cfg: GatewayConfig = cfg) -> Any:
        parts = [
            {"type": "text", "text": "What is in"},
            {"type": "image_url", "image_url": {"url": url(wide)}},
            {"type": "text", "text": between},
            {"type": "image_url", "image_url": {"url": url(tall)}},
        ]
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]}
        return asyncio.run(
            prepare(validate_http(ChatRequest, orjson.dumps(body), cfg), Api.CHAT, model, 4096, cfg)
        )

    got = ours(" and here?")
    hf = transformers.Idefics3Processor(
        transformers.Idefics3ImageProcessor(**PRE),
        transformers.PreTrainedTokenizerFast.from_pretrained(str(vlm_dir)),
        image_seq_len=4,
        chat_template=TEMPLATE,
    )
    hf_parts = [
        {"type": "text", "text": t} if t else {"type": "image"} for t in ("What is in", "", " and here?", "")
    ]
    hf_msgs = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    text = hf.apply_chat_template(
        hf_msgs + [{"role": "user", "content": hf_parts}], add_generation_prompt=True
    )
    assert got.prompt_ids == hf(text=text, images=[[wide, tall]])["input_ids"][0]
    (a, span_a), (b, span_b) = got.images
    image_id = model.codec.token_id(IMAGE)
    assert [a.width, b.width] == [100, 20] and a.digest != b.digest == span_b.digest
    assert got.prompt_ids[span_a.start] == model.codec.token_id(AROUND)
    assert (
        got.prompt_ids[span_a.start : span_a.start + span_a.length].count(image_id) == 10 * 4
    )  # 3x3 + global
    assert (
        got.prompt_ids[span_b.start : span_b.start + span_b.length].count(image_id) == 7 * 4
    )  # 3x2 + global
    typed = ours(" and <image> here?")  # a special token's text typed by the client
    assert typed.prompt_ids.count(image_id) == got.prompt_ids.count(image_id)
    for (_, was), (_, now) in zip(got.images, typed.images, strict=True):  # the same placeholders
        assert (
            typed.prompt_ids[now.start : now.start + now.length]
            == got.prompt_ids[was.start : was.start + was.length]
        )
    assert model.codec.encode_text("<image>")[0] != image_id
    # what crosses the broker: each file as sent, its digest and span, within the setting
    sent = [PromptImage.of(im.data, im.digest, s.start, s.length) for im, s in got.images]
    req = GenerateRequest("r", got.prompt_ids, got.params, images=sent)
    assert decode_request(encode(req)).images[1].file() == _png(tall)
    with pytest.raises(APIError, match="limit for one request is 200"):
        ours(" and here?", GatewayConfig(max_request_image_bytes=200))
    with pytest.raises(ValueError, match="max_request_image_bytes"):  # past what the wire carries
        GatewayConfig(max_request_image_bytes=65 << 20)


def test_the_encoder_steps_rows_are_hfs_merged_inputs(models: tuple[Any, Idefics3Vision]) -> None:
    """The engine's encoder step: two images' files -> tiles -> encoder,
    scattered at their `<image>` tokens over two prefill chunks that split the first
    image, equal transformers' `inputs_merger` of `get_image_features`; the same image
    again (another request, same root) is a cache hit and the encoder does not run;
    another tenant's root runs it."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from wsllm.engine.encoder_cache import EncoderCache
    from wsllm.engine.encoder_step import EncoderStep, ImageWork
    from wsllm.server.images import ImageLimits, decode
    from wsllm.types import PromptImage

    hf, vision = models
    spec = PixelSpec.from_hf(PRE, tokens_per_tile=4)
    a, b = (
        PILImage.effect_noise((100, 70), 60).convert("RGB"),
        PILImage.effect_noise((20, 30), 40).convert("RGB"),
    )
    limits = ImageLimits(1 << 20, 1 << 20, 4, 4)
    ids, images = [7, 8], []
    for im in (a, b):  # each tile's tokens as the processor writes them: a tag, then 4 <image>
        n = spec.tiling.num_tiles(im.height, im.width)
        holder = [11, 12, *([299] * 4)] * n + [11]
        images.append(PromptImage.of(_png(im), decode(_png(im), "x", limits).digest, len(ids), len(holder)))
        ids += holder + [9]
    step = EncoderStep(Idefics3ImageSide(vision, spec), EncoderCache(1 << 20))
    work = ImageWork("r1", b"tenant-a", ids, images)
    rows = step.encode([work])[0]["r1"]
    assert step.cache.stats.runs == 2 and step.cache.stats.hits == 0
    with torch.no_grad():
        pixels = Idefics3ImageProcessorPil(**PRE)([[a, b]], return_tensors="pt")["pixel_values"]
        features = torch.cat([f.reshape(-1, 48) for f in hf.model.get_image_features(pixels).pooler_output])
        embeds = hf.model.get_input_embeddings()(torch.tensor([ids]))
        want = hf.model.inputs_merger(torch.tensor([ids]), embeds, features)[0]
    got = embeds[0].clone()
    cut = images[0].start + 9  # inside the first image's second tile
    for first, end in ((0, cut), (cut, len(ids))):
        part = step.scatter(work, rows, first, end)
        assert part is not None
        got[first:end][part[0]] = part[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert step.scatter(work, rows, 0, 2) is None  # text alone
    twice = ImageWork("r2", b"tenant-a", ids, images[1:2] * 2)  # repeated in one request too
    again = step.encode([twice])[0]["r2"]
    assert step.cache.stats.runs == 2 and step.cache.stats.hits == 1
    torch.testing.assert_close(again[0], rows[1], rtol=0, atol=0)
    step.encode([ImageWork("r3", b"tenant-b", ids, images[1:2])])
    assert step.cache.stats.runs == 3
    broken = list(ids)
    broken[images[1].start + 2] = 7  # an <image> token of the second image is text: refused
    corrupt = PromptImage.of(_png(a)[:100], "cd" * 32, images[0].start, images[0].length)
    bad = [ImageWork("r4", None, broken, images), ImageWork("r5", None, ids, [corrupt, images[1]])]
    good, failed = step.encode([*bad, ImageWork("r6", None, ids, images)])
    assert (
        list(good) == ["r6"] and "images.1 has" in failed["r4"] and "images.0 does not decode" in failed["r5"]
    )
