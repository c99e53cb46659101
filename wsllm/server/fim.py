"""Fill-in-the-middle: a completion's `prompt` (the text before the cursor) and `suffix`
(the text after it) become one prompt in the FIM order the model was trained on, and the
model writes the middle.

A model is recognised by its tokenizer alone: the first convention of `CONVENTIONS`
whose three tokens are all in its vocabulary is the model's. Both conventions here are
prefix-suffix-middle (PSM): `<prefix tag> prefix <suffix tag> suffix <middle tag>`; a
convention that puts the suffix first (SPM) is a row with `order="spm"`. Neither
convention's models are trained with a BOS before the first tag, so none is added.

The prefix and suffix are text: a FIM tag written inside them (a source file about FIM
prompts) stays text and cannot reorder the prompt (`TextCodec.encode_text`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wsllm.server.text import TextCodec


@dataclass(frozen=True, slots=True)
class FimConvention:
    """One family's FIM tokens, as its tokenizer spells them."""

    name: str
    prefix: str
    suffix: str
    middle: str
    #: psm: prefix, suffix, middle; spm: suffix first, then prefix, then middle
    order: Literal["psm", "spm"] = "psm"


#: The conventions recognised, tried in this order (docs/protocol.md, "Fill in the middle").
CONVENTIONS: tuple[FimConvention, ...] = (
    # Qwen2.5-Coder, Qwen3-Coder
    FimConvention("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    # StarCoder, StarCoder2, SantaCoder and the models that share their tokenizer
    FimConvention("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A convention's token ids in one model's vocabulary."""

    convention: FimConvention
    prefix_id: int
    suffix_id: int
    middle_id: int

    def build(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """The prompt's token ids: the text before and after the cursor, with the tags,
        in the convention's order."""
        pre = [self.prefix_id, *prefix_ids]
        suf = [self.suffix_id, *suffix_ids]
        body = pre + suf if self.convention.order == "psm" else suf + pre
        return [*body, self.middle_id]


def fim_tokens(codec: TextCodec) -> FimTokens | None:
    """The model's FIM tokens, or None when its vocabulary has no convention's three."""
    for conv in CONVENTIONS:
        p, s, m = (codec.token_id(t) for t in (conv.prefix, conv.suffix, conv.middle))
        if p is not None and s is not None and m is not None:
            return FimTokens(conv, p, s, m)
    return None


def fim_prompt(codec: TextCodec, prefix: str, suffix: str) -> list[int]:
    """The FIM prompt of `prefix` and `suffix` for this model; ValueError, with the
    reason, when its tokenizer has no FIM tokens."""
    tokens = fim_tokens(codec)
    if tokens is None:
        names = "; ".join(f"{c.prefix} {c.suffix} {c.middle}" for c in CONVENTIONS)
        raise ValueError(f"this model's tokenizer has no fill-in-the-middle tokens (one of: {names})")
    return tokens.build(codec.encode_text(prefix), codec.encode_text(suffix))
