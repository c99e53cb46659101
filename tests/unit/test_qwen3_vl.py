"""Qwen3-VL's pieces (wsllm/models/vision/qwen3_vl*.py, wsllm/models/qwen3_vl*.py) over a tiny
random-weight Qwen3VLForConditionalGeneration that transformers builds, in fp32: an image's
patches are HF's image processor's (its PIL backend), the vision tower's rows and deepstack
rows HF's `get_image_features`, the 3-D rotary positions HF's `get_rope_index`; the family
serves its text as HF generates, and the pieces composed (tower -> rows at the placeholders ->
text model with 3-D rotary and deepstack, then decode at index + delta) give HF's logits and
HF's greedy tokens for a prompt with two images."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image as PILImage
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from wsllm import kernels
from wsllm.broker.base import TOKENIZER_FILES
from wsllm.image_grid import VisionGrid
from wsllm.models import qwen3_vl, qwen3_vl_text
from wsllm.models.causal_lm import CausalLM
from wsllm.models.layers.attention import AttentionMetadata
from wsllm.models.vision import qwen3_vl_pixels, qwen3_vl_rope
from wsllm.models.vision.qwen3_vl import Qwen3VLVision
from wsllm.models.vision.qwen3_vl_pixels import PixelSpec
from wsllm.models.vision.qwen3_vl_rope import ImageGrid

IMAGE, START, END = 299, 297, 296
TINY = {
    "vision_config": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,  # a 4 x 4 table, resized to each grid
        "deepstack_visual_indexes": [0, 1],
    },
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
        # t takes what h and w leave: frequencies 1, 4 turn by h, 2, 5 by w, 0, 3, 6, 7 by t
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
    },
    "image_token_id": IMAGE,
    "video_token_id": 298,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
}
# patches of 8, merged 2 x 2: sides in multiples of 16, within [1024, 8192] pixels
PRE = {
    "patch_size": 8,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 1024, "longest_edge": 8192},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@pytest.fixture(scope="module")
def models() -> tuple[Any, Qwen3VLVision, CausalLM]:
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**TINY)).eval()
    with torch.no_grad():  # larger weights than the default init give peaked, varied logits
        for name, p in hf.named_parameters():
            if p.dim() > 1 and "language_model" in name or name == "lm_head.weight":
                p.normal_(0, 0.08)
    cfg = hf.config.to_dict()
    vision = Qwen3VLVision.from_hf(cfg)
    vision.load_hf(hf.state_dict())
    text = CausalLM(qwen3_vl.config(cfg))
    fam = qwen3_vl.FAMILY
    text.load_weights(fam.weights((n, w) for n, w in hf.state_dict().items() if not fam.is_image_side(n)))
    return hf, vision.eval(), text.eval()


def _image(size: tuple[int, int], seed: int) -> PILImage.Image:
    torch.manual_seed(seed)
    return PILImage.fromarray(torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8).numpy())


@pytest.mark.parametrize(
    ("size", "grid"),
    [((100, 70), (1, 8, 12)), ((20, 50), (1, 8, 4)), ((10, 12), (1, 6, 4)), ((300, 200), (1, 8, 12))],
    ids=["wide", "tall", "min-pixels", "max-pixels"],
)
def test_the_patches_are_hfs_image_processors(size: tuple[int, int], grid: tuple[int, int, int]) -> None:
    """Resized, normalized and patchified pixel for pixel as transformers' Qwen2-VL image
    processor (PIL backend): a non-square image, a tall one, one brought up to min_pixels,
    one brought down within max_pixels; the grid is what the gateway counts from the size."""
    image = _image(size, 1)
    hf = Qwen2VLImageProcessorPil(**PRE)(image, return_tensors="pt")
    spec = PixelSpec.from_hf(PRE)
    got, got_grid = qwen3_vl_pixels.patches(image, spec)
    assert got_grid == tuple(hf["image_grid_thw"][0].tolist()) == grid
    assert spec.grid.grid(image.height, image.width) == grid
    assert spec.grid.num_tokens(image.height, image.width) == grid[1] * grid[2] // 4
    torch.testing.assert_close(got, hf["pixel_values"], rtol=0, atol=0)


def test_a_too_long_image_is_refused_as_hf_does() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        VisionGrid.from_hf(PRE).resized(1, 201)


def _png(img: PILImage.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def _two_images() -> tuple[list[PILImage.Image], Any]:
    images = [_image((100, 70), 2), _image((20, 50), 3)]
    return images, Qwen2VLImageProcessorPil(**PRE)(images, return_tensors="pt")


def test_the_towers_rows_are_hfs_image_features(models: tuple[Any, Qwen3VLVision, CausalLM]) -> None:
    """Two images of different grids in one batch: each token's input row and its deepstack
    rows equal HF's `get_image_features` (pooler output, deepstack features) in fp32; an
    image's rows do not depend on the image beside it."""
    hf, vision, _ = models
    _, pixels = _two_images()
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        want = hf.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        packed = vision(pixels["pixel_values"], grids)
    rows, stacked = vision.unpack(packed)
    assert packed.shape == (24 + 8, 3 * 64) and len(stacked) == vision.levels == 2
    torch.testing.assert_close(rows, torch.cat(want.pooler_output), rtol=1e-5, atol=1e-5)
    for got, level in zip(stacked, want.deepstack_features, strict=True):
        torch.testing.assert_close(got, torch.cat(level), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        alone = vision(pixels["pixel_values"][96:], grids[1:])
    torch.testing.assert_close(alone, packed[24:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="for grids"):
        vision(pixels["pixel_values"][:10], grids)


def _prompt(grids: list[tuple[int, int, int]], text_after: int = 2) -> list[int]:
    """Text, then each image's start, pads, end, then text (HF's placeholders' layout)."""
    ids = [5, 6, 7]
    for _, h, w in grids:
        ids += [START] + [IMAGE] * (h * w // 4) + [END, 8]
    return ids + [9] * text_after


def _grids_of(ids: list[int], grids: list[tuple[int, int, int]]) -> list[ImageGrid]:
    out, at = [], 0
    for _, h, w in grids:
        at = ids.index(IMAGE, at)
        out.append(ImageGrid(at, h // 2, w // 2))
        at += h * w // 4
    return out


@pytest.mark.parametrize("n_images", [1, 2])
def test_the_3d_positions_are_hfs_rope_index(
    models: tuple[Any, Qwen3VLVision, CausalLM], n_images: int
) -> None:
    """The prompt's [3, n] positions and its delta equal HF's `get_rope_index`; a text row
    (t = h = w) is the 1-D table's row at that position bit for bit."""
    hf, _, text = models
    _, pixels = _two_images()
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()][:n_images]
    ids = _prompt(grids)
    t = torch.tensor([ids])
    want, want_delta = hf.model.get_rope_index(
        t, (t == IMAGE).int(), image_grid_thw=pixels["image_grid_thw"][:n_images]
    )
    got, delta = qwen3_vl_rope.positions(len(ids), _grids_of(ids, grids))
    assert got.tolist() == want[:, 0].tolist() and delta == int(want_delta) < 0
    axis = qwen3_vl_rope.axes(16, qwen3_vl.mrope_section(hf.config.to_dict()))
    assert axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    rows = qwen3_vl_rope.rope_rows(text.cos_sin_cache, got, axis)
    is_text = torch.tensor(ids) != IMAGE
    assert torch.equal(rows[is_text], text.cos_sin_cache[got[0, is_text]])
    with pytest.raises(ValueError, match="does not fit"):
        qwen3_vl_rope.positions(len(ids), [ImageGrid(len(ids) - 2, 2, 2)])


def test_a_qwen3_vl_checkpoint_serves_its_text_as_hf_generates(
    models: tuple[Any, Qwen3VLVision, CausalLM], tmp_path: Path, smollm_dir: Path
) -> None:
    """The family's registry entry: the text model of a Qwen3-VL checkpoint (text config
    nested, `language_model.*`, the `visual.*` tensors left to the image side) loads through
    the real engine and gives HF's greedy tokens on a text prompt (M-RoPE on text alone is
    1-D rotary)."""
    from wsllm.llm import LLM
    from wsllm.types import SamplingParams

    hf = models[0]
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
    bad = hf.config.to_dict()
    bad["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 1]
    with pytest.raises(ValueError, match=r"mrope_section \[4, 2, 1\] must sum to head_dim / 2 = 8"):
        qwen3_vl.config(bad)


class _Seq:
    """One sequence's paged KV cache and the metadata of its steps (the model runner's job)."""

    def __init__(self, model: CausalLM, tokens: int, block: int = 16) -> None:
        c = model.config
        self.block, n = block, (tokens + block - 1) // block
        shape = (n, block, c.num_kv_heads, c.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
        self.tables = torch.arange(n, dtype=torch.int32)[None]

    def meta(
        self, first: int, end: int, rope: torch.Tensor | None = None, at: Any = None
    ) -> AttentionMetadata:
        """The step [first, end)'s metadata; with `rope`, its CPU plan (the engine's CPU path)
        reading that table at `at` (the model runner's positions)."""
        q = end - first
        slots = torch.arange(first, end)
        plan = None
        if rope is not None:
            tables = [self.tables[0].tolist()]
            plan = kernels.plan_cpu_attention(tables, [end], [q], self.block, torch.float32, at, rope, slots)
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.tables,
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            max_query_len=q,
            is_decode=q == 1,
            max_seq_len=end,
            cpu_plan=plan,
        )


@pytest.mark.parametrize("planned", [False, True], ids=["kernels", "cpu-plan"])
def test_an_image_prompt_gives_hfs_logits_and_greedy_tokens(
    models: tuple[Any, Qwen3VLVision, CausalLM], planned: bool
) -> None:
    """The pieces composed as the engine will run them: the images' files prepared and
    encoded in one batch, their grids read from the files' headers, the rows at the placeholders,
    the text model over two prefill chunks (the cut inside the first image) with 3-D rotary
    rows and deepstack added after its first layers: HF's logits; then decode steps at
    index + delta through `CausalLM.forward` unchanged: HF's greedy tokens. The same through
    the CPU attention plan, built as the model runner builds it (from the chunk's rotary
    rows at arange for a prefill, from the model's table at index + delta for a decode)."""
    hf, vision, text = models
    images, pixels = _two_images()
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    ids = _prompt(grids)
    t = torch.tensor([ids])
    spec = PixelSpec.from_hf(PRE)
    files = [_png(im) for im in images]
    with torch.no_grad():
        want = hf(input_ids=t, mm_token_type_ids=(t == IMAGE).int(), **pixels).logits[0]
    rows = torch.cat(vision.encode([qwen3_vl_pixels.prepare(f, spec) for f in files]))
    placed = [
        qwen3_vl_pixels.prompt_grid(f, spec, g.start)
        for f, g in zip(files, _grids_of(ids, grids), strict=True)
    ]
    assert placed == _grids_of(ids, grids)
    pos3, delta = qwen3_vl_rope.positions(len(ids), placed)
    rope = qwen3_vl_rope.rope_rows(text.cos_sin_cache, pos3, qwen3_vl_rope.axes(16, [4, 2, 2]))
    holes = (t[0] == IMAGE).nonzero().flatten()
    seq = _Seq(text, len(ids) + 8)
    hidden = []
    with torch.no_grad():
        for first, end in ((0, 12), (12, len(ids))):  # token 12: inside the first image
            inside = (holes >= first) & (holes < end)
            images = qwen3_vl_text.ImageRows(holes[inside] - first, rows[inside])
            chunk = rope[first:end]
            meta = seq.meta(first, end, chunk, torch.arange(end - first)) if planned else seq.meta(first, end)
            part = qwen3_vl_text.forward(text, t[0, first:end], chunk, seq.kv, meta, images)
            hidden.append(part)
        got = text.compute_logits(torch.cat(hidden))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tokens = [int(got[-1].argmax())]
    with torch.no_grad():
        for i in range(len(ids), len(ids) + 5):  # decode: the 1-D table at index + delta
            step = text.forward(
                torch.tensor(tokens[-1:]), torch.tensor([i + delta]), seq.kv, seq.meta(i, i + 1)
            )
            tokens.append(int(text.compute_logits(step)[-1].argmax()))
        out = hf.generate(
            input_ids=t,
            mm_token_type_ids=(t == IMAGE).int(),
            **pixels,
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
        )
    assert tokens == out[0, len(ids) :].tolist()
