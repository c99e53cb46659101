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

from wsllm.broker.base import TOKENIZER_FILES
from wsllm.image_tiles import AROUND, GLOBAL, IMAGE, Tiling
from wsllm.models.vision import idefics3_pixels
from wsllm.models.vision.idefics3 import Idefics3Vision
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
