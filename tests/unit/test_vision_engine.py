"""A model that sees, end to end in the engine (docs/vision.md): a tiny random-weight SmolVLM
(`tiny_smolvlm_dir`) gives HF `generate`'s greedy tokens in fp32 for images and text (one
image; two, the first in an earlier turn), also through chunked prefills that split an
image's placeholders; the same image again is a prefix hit and the encoder does not run, a
different image or another tenant misses, a hit ending inside an image reads the rest from
the encoder cache; nothing stays held after an abort or a preemption."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import transformers
from PIL import Image as PILImage
from tiny_vlm import SMOLVLM_PRE, hf_processor, hf_prompt, hf_tokens, png

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.image_tiles import Tiling
from wsllm.server.images import ImageLimits, decode
from wsllm.types import GenerateRequest, PromptImage, SamplingParams

MAX_TOKENS = 6


WIDE = png(PILImage.effect_noise((100, 70), 60).convert("RGB"))  # 3 x 3 tiles and a global view
TALL = png(PILImage.effect_noise((20, 50), 40).convert("RGB"))  # 3 x 2 tiles and a global view
OTHER = png(PILImage.effect_noise((100, 70), 90).convert("RGB"))  # WIDE's size, other pixels


@pytest.fixture(scope="module")
def hf(tiny_smolvlm_dir: Path) -> Any:
    return transformers.Idefics3ForConditionalGeneration.from_pretrained(str(tiny_smolvlm_dir)).eval()


@pytest.fixture(scope="module")
def processor(tiny_smolvlm_dir: Path) -> Any:
    return hf_processor(tiny_smolvlm_dir)


def engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    cfg = dict(model=str(model_dir), num_kv_blocks=256, dtype="float32", kv_cache_dtype="float32")
    return LLMEngine.from_config(EngineConfig(**(cfg | overrides)))


@pytest.fixture(scope="module")
def whole(tiny_smolvlm_dir: Path) -> LLMEngine:
    return engine(tiny_smolvlm_dir)


@pytest.fixture(scope="module")
def chunked(tiny_smolvlm_dir: Path) -> LLMEngine:
    """Prefills of 16 tokens (an image's 40 placeholders span three), no prefix cache."""
    return engine(
        tiny_smolvlm_dir,
        max_num_batched_tokens=16,
        prefill_tokens_while_decoding=16,
        enable_prefix_caching=False,
    )


# conversations: (turns of (role, parts)), each part text or an image file
ONE = [("user", ["What is in", WIDE, "?"])]
LONG = [
    ("user", ["What is in", WIDE, "? Tell me in a few short words, please, and kindly."])
]  # past its blocks
EARLIER = [("user", [WIDE, "Describe it."]), ("assistant", ["A field."]), ("user", ["And", TALL, "this?"])]


def image_request(
    rid: str, ids: list[int], files: list[bytes], image_id: int, salt: str = ""
) -> GenerateRequest:
    """Each image's span: its run of `<image>` placeholders (4 per tile, in prompt order)."""
    limits = ImageLimits(1 << 20, 1 << 20, 4, 4)
    at = [i for i, t in enumerate(ids) if t == image_id]
    images, used = [], 0
    tiling = Tiling.from_hf(SMOLVLM_PRE, tokens_per_tile=4)
    for f in files:
        size = PILImage.open(io.BytesIO(f)).size
        n = tiling.num_tiles(size[1], size[0]) * 4
        first, last = at[used], at[used + n - 1]
        images.append(PromptImage.of(f, decode(f, "x", limits).digest, first, last - first + 1))
        used += n
    assert used == len(at)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return GenerateRequest(rid, ids, params, cache_salt=salt, images=images)


def run(eng: LLMEngine, *reqs: GenerateRequest) -> dict[str, Any]:
    for r in reqs:
        eng.add_request(r)
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_nothing_held(eng: LLMEngine) -> None:
    assert eng.images is not None and eng.images.held == 0 and eng.images.cache.num_held == 0
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks
    eng.block_manager.check_invariants()


@pytest.mark.parametrize("turns", [ONE, EARLIER], ids=["one image", "two images, one in an earlier turn"])
@pytest.mark.parametrize("which", ["whole", "chunked"])
def test_greedy_tokens_are_hfs(
    request: pytest.FixtureRequest, hf: Any, processor: Any, turns: Any, which: str
) -> None:
    eng = request.getfixturevalue(which)
    ids, files = hf_prompt(processor, turns)
    image_id = hf.config.image_token_id
    req = image_request(f"{which}-{len(files)}", ids, files, image_id, salt=f"greedy-{which}")
    if which == "chunked":  # the first image's placeholders span several 16-token chunks
        assert req.images[0].start // 16 < (req.images[0].start + req.images[0].length) // 16 - 1
    got = run(eng, req)[req.request_id]
    assert got.error is None and got.outputs[0].token_ids == hf_tokens(hf, ids, files, MAX_TOKENS)
    assert_nothing_held(eng)


def test_the_same_image_again_is_a_prefix_hit_and_no_encoder_run(
    whole: LLMEngine, processor: Any, hf: Any
) -> None:
    image_id = hf.config.image_token_id
    ids, files = hf_prompt(processor, LONG)
    enc = whole.images
    assert enc is not None

    def once(
        rid: str, files: list[bytes], salt: str = "tenant-a", ids: list[int] = ids
    ) -> tuple[Any, int, int]:
        runs, hits = enc.cache.stats.runs, enc.cache.stats.hits
        out = run(whole, image_request(rid, ids, files, image_id, salt))[rid]
        assert out.error is None
        return out, enc.cache.stats.runs - runs, enc.cache.stats.hits - hits

    first, runs, _ = once("first", files)
    span = image_request("x", ids, files, image_id).images[0]
    assert first.num_cached_tokens == 0 and runs == 1
    again, runs, hits = once("again", files)
    assert again.num_cached_tokens >= span.start + span.length  # the image's blocks were hits
    assert (runs, hits) == (0, 0)  # the encoder did not run: no chunk computed its placeholders
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other, runs, _ = once("other image", [OTHER])  # same text, same placeholders, other pixels
    assert other.num_cached_tokens <= span.start and runs == 1
    tenant, runs, _ = once("other tenant", files, salt="tenant-b")
    assert tenant.num_cached_tokens == 0 and runs == 1
    moved, more = hf_prompt(processor, [("user", ["Look at", *LONG[0][1][1:]])])  # other text before it
    shifted, runs, hits = once("shifted", more, ids=moved)
    assert shifted.num_cached_tokens < span.start and (runs, hits) == (0, 1)  # the encoder cache's
    s = whole.stats()
    assert s.encoder_runs == enc.cache.stats.runs and s.encoder_hits == enc.cache.stats.hits > 0
    assert_nothing_held(whole)


def test_a_hit_that_ends_inside_an_image_takes_the_rest_of_its_rows_from_the_encoder_cache(
    whole: LLMEngine, processor: Any, hf: Any
) -> None:
    """ONE's blocks end inside its image; LONG (its text continued) hits them, computes the
    image's last placeholders from the encoder cache's rows, and equals HF."""
    image_id, enc = hf.config.image_token_id, whole.images
    assert enc is not None
    (a, fa), (b, fb) = hf_prompt(processor, ONE), hf_prompt(processor, LONG)
    run(whole, image_request("partial-a", a, fa, image_id, salt="partial"))
    runs, hits = enc.cache.stats.runs, enc.cache.stats.hits
    got = run(whole, image_request("partial-b", b, fb, image_id, salt="partial"))["partial-b"]
    span = image_request("x", b, fb, image_id).images[0]
    assert span.start < got.num_cached_tokens < span.start + span.length
    assert (enc.cache.stats.runs - runs, enc.cache.stats.hits - hits) == (0, 1)
    assert got.outputs[0].token_ids == hf_tokens(hf, b, fb, MAX_TOKENS)
    assert_nothing_held(whole)


def test_nothing_stays_held_after_an_abort(chunked: LLMEngine, processor: Any, hf: Any) -> None:
    ids, files = hf_prompt(processor, ONE)
    chunked.add_request(image_request("aborted", ids, files, hf.config.image_token_id))
    for _ in range(3):  # into the image's placeholders, not through them
        chunked.step()
    assert chunked.images is not None and chunked.images.held == 1
    chunked.abort("aborted")
    chunked.step()
    assert_nothing_held(chunked)


def test_a_preempted_request_reencodes_and_nothing_stays_held(
    tiny_smolvlm_dir: Path, processor: Any, hf: Any
) -> None:
    """Two image requests in KV for about one and a half: the newer one is preempted by
    recompute in the middle of its prompt, encoded again later, and both equal HF."""
    image_id = hf.config.image_token_id
    (a, fa), (b, fb) = hf_prompt(processor, ONE), hf_prompt(processor, [("user", ["Here", TALL, "."])])
    blocks = (len(a) + MAX_TOKENS) // 16 + (len(b) + MAX_TOKENS) // 16
    eng = engine(
        tiny_smolvlm_dir, num_kv_blocks=blocks, max_num_batched_tokens=16,
        prefill_tokens_while_decoding=16, enable_prefix_caching=False, watermark=0.0,
    )  # fmt: skip
    got = run(eng, image_request("a", a, fa, image_id), image_request("b", b, fb, image_id))
    s = eng.stats()
    assert s.num_preemptions >= 1 and s.encoder_runs + s.encoder_hits >= 3  # its image read again
    assert got["a"].outputs[0].token_ids == hf_tokens(hf, a, fa, MAX_TOKENS)
    assert got["b"].outputs[0].token_ids == hf_tokens(hf, b, fb, MAX_TOKENS)
    assert_nothing_held(eng)
