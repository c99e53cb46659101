"""Fill-in-the-middle prompts (server/fim.py) on real tokenizers: each convention's
tokens are found in a vocabulary that has them and put in the model's order around the
prefix and suffix; a FIM tag typed in the text stays text; the bundled SmolLM2 has no
FIM tokens, and says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wsllm.server.fim import CONVENTIONS, FimConvention, FimTokens, fim_prompt, fim_tokens
from wsllm.server.text import TextCodec


@pytest.mark.parametrize("conv", CONVENTIONS, ids=lambda c: c.name)
def test_the_prompt_is_prefix_suffix_middle_in_the_models_ids(
    word_tokenizer: Any, conv: FimConvention
) -> None:
    codec = TextCodec(str(word_tokenizer([conv.prefix, conv.suffix, conv.middle])))
    tags = [codec.token_id(t) for t in (conv.prefix, conv.suffix, conv.middle)]
    assert tags == [509, 510, 511]  # added after the words: the tags are really specials
    w = {f"w{i}": codec.token_id(f"w{i}") for i in range(1, 6)}
    ids = fim_prompt(codec, "w1 w2", "w3 w4 w5")
    assert ids == [509, w["w1"], w["w2"], 510, w["w3"], w["w4"], w["w5"], 511]
    found = fim_tokens(codec)
    assert found is not None and found.convention == conv


def test_a_tag_typed_in_the_text_stays_text(word_tokenizer: Any) -> None:
    conv = CONVENTIONS[0]
    codec = TextCodec(str(word_tokenizer([conv.prefix, conv.suffix, conv.middle])))
    ids = fim_prompt(codec, f"w1 {conv.middle}", "w2")
    # The middle tag ends the prompt and nowhere else: the typed one was split as text.
    assert ids.count(511) == 1 and ids[-1] == 511 and ids[0] == 509


def test_a_suffix_first_convention_puts_the_suffix_first() -> None:
    spm = FimTokens(FimConvention("spm", "<p>", "<s>", "<m>", order="spm"), 7, 8, 9)
    assert spm.build([1, 2], [3]) == [8, 3, 7, 1, 2, 9]


def test_a_vocabulary_with_only_some_tags_has_no_fim(word_tokenizer: Any) -> None:
    conv = CONVENTIONS[0]
    codec = TextCodec(str(word_tokenizer([conv.prefix, conv.suffix])))
    assert fim_tokens(codec) is None


def test_the_bundled_model_has_no_fim_tokens_and_the_error_says_why(smollm_dir: Path) -> None:
    codec = TextCodec(str(smollm_dir))
    assert fim_tokens(codec) is None
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens.*<\\|fim_prefix\\|>"):
        fim_prompt(codec, "def f(", "):")
