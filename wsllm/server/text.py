"""Text work in the gateway: chat templates, tokenization, incremental detokenization
and stop strings. The engine only ever sees token ids.

Incremental detokenization uses `tokenizers.decoders.DecodeStream`, which keeps a
window of context tokens: a token that ends in the middle of a multi-byte UTF-8
character yields nothing until the character is complete (so no U+FFFD is ever sent
for valid output), and SentencePiece-style tokenizers get their leading spaces right
because the window starts inside the prompt.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from wsllm.image_grid import VisionGrid
from wsllm.image_tiles import IMAGE, Tiling

log = logging.getLogger(__name__)

# Prompt tokens given to each detokenizer as context (leading spaces, merges).
_CONTEXT_TOKENS = 5
# Texts longer than this go through the tokenizer's batch calls, which release the GIL.
_GIL_FREE_ABOVE = 4096
# token_strs of at most this many ids: one tokenizer call each (well under a ms), no vocabulary table.
_STRS_ONE_BY_ONE = 4096
# Stand-ins for message contents while a template renders (private-use characters,
# which no template trims or escapes).
_MARK = re.compile("\ue000(\\d+)\ue001")


def _marked(part: dict[str, Any], marks: Any) -> dict[str, Any]:
    return part | {"text": f"\ue000{next(marks)}\ue001"} if part.get("type") == "text" else part


class TemplateError(ValueError):
    """The chat template refused the messages (e.g. roles that must alternate)."""


class ToolPrompt(Protocol):
    """Writes tools and earlier calls into plain messages, for a chat template that
    knows nothing of tools (the chat styles)."""

    def inline(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]: ...


class TextCodec:
    """A model's tokenizer, loaded from an HF-style directory (tokenizer.json,
    tokenizer_config.json and its chat template)."""

    def __init__(self, tokenizer_dir: str) -> None:
        # Not AutoTokenizer: it imports torch, and the gateway must stay light.
        from transformers import PreTrainedTokenizerFast

        self.hf: Any = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"{tokenizer_dir}: a fast tokenizer (tokenizer.json) is needed for streaming")
        self.backend: Tokenizer = backend
        self.vocab_size: int = len(self.hf)
        #: the longest token's string, in characters: no text of more than n times this
        #: many is n tokens or fewer (byte-level strings are no shorter than their text)
        self.max_token_chars: int = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self._token_text: dict[int, str] = {}
        self._vocab_strs: list[str | None] | None = None  # id -> its vocabulary string (token_strs)
        # A message's text is text: a special token typed in it (e.g. "<|im_end|>") must
        # not become the control token. This copy reads special tokens as plain text.
        decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
        self._specials = sorted({t.content for t in decoder.values() if getattr(t, "special", False)})
        self._literal = Tokenizer.from_str(backend.to_str())
        self._literal.encode_special_tokens = True
        #: how the model's processor turns an image into placeholder tokens: SmolVLM's
        #: tiles or Qwen3-VL's grid; None: it reads text only (docs/vision.md)
        self.tiling: Tiling | VisionGrid | None = Tiling.from_dir(tokenizer_dir) or VisionGrid.from_dir(
            tokenizer_dir
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt, with the special tokens the model expects (e.g. BOS)."""
        return _encode(self.backend, text, add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        """Text as plain text: no special tokens added, and none read from what it says
        (a FIM prompt's prefix and suffix)."""
        return _encode(self._literal, text, False)

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary, special or not; None when absent."""
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens kept (/detokenize, a token-id prompt's echo)."""
        if len(token_ids) <= _GIL_FREE_ABOVE // 4:
            return str(self.backend.decode(token_ids, skip_special_tokens=False))
        return str(self.backend.decode_batch([token_ids], skip_special_tokens=False)[0])  # frees the GIL

    @property
    def chat_template(self) -> str:
        """The chat template's source ("" without one; named templates joined)."""
        t = getattr(self.hf, "chat_template", None) or ""
        return "\n".join(str(v) for v in t.values()) if isinstance(t, dict) else str(t)

    def prompt_tail(self, prompt_token_ids: list[int], n: int = 8) -> str:
        """The text of a prompt's last tokens, special tokens included."""
        return str(self.backend.decode(list(prompt_token_ids[-n:]), skip_special_tokens=False))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja2 raises TemplateError or anything the template raises
            raise TemplateError(f"the chat template refused these messages: {e}") from e
        return str(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tool_prompt: ToolPrompt | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The chat prompt's token ids. The template writes the special tokens itself
        (no second BOS); what the messages say is always plain text. `tools` go to the
        template; one that does not mention tools gets them from `tool_prompt` instead,
        written into the messages."""
        if tools and tool_prompt is not None and "tools" not in self.chat_template:
            messages, tools = tool_prompt.inline(messages, tools), None
        render = lambda ms: self.render_chat(  # noqa: E731
            ms, tools, template_kwargs, add_generation_prompt, continue_final_message
        )
        if not any(sp in m["content"] for m in messages for sp in self._specials):
            return _encode(self.backend, render(messages), False)
        # Render with a mark per content, then tokenize the template's own text with its
        # special tokens and each content as plain text.
        marked = [m | {"content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        parts = _MARK.split(render(marked))
        seen = [int(i) for i in parts[1::2]]
        if len(set(seen)) != len(seen) or any(i >= len(messages) for i in seen):
            raise TemplateError("this model's chat template cannot take special-token text in a message")
        return self._with_literals(parts, [m["content"] for m in messages])

    def _with_literals(self, parts: list[str], literals: list[str]) -> list[int]:
        """`parts` as `_MARK.split` gives them: the template's own text (special tokens
        read) and, at odd places, the index of a text in `literals` to read as plain text."""
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                ids += _encode(self.backend, part, False)
            else:
                ids += _encode(self._literal, literals[int(part)], False)
        return ids

    def encode_chat_images(
        self,
        messages: list[dict[str, Any]],
        images: list[list[int]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> tuple[list[int], list[int]]:
        """The token ids of a chat whose contents are lists of parts (`{"type": "text",
        "text": ...}`, `{"type": "image"}`: HF's processors' input), each image the template
        writes (`tiling.marker`) replaced by the next image's placeholder ids (`images`); and
        where each image's placeholders start. A text part is read as plain text (a
        special token typed in it stays text); with none, the text between images is
        tokenized as HF's processor does, whole, for the same ids."""
        texts = [p for m in messages for p in m["content"] if p.get("type") == "text"]
        literal = any(sp in p["text"] for p in texts for sp in self._specials)
        if literal:  # each text part a mark, read back as plain text
            marks = iter(range(len(texts)))
            messages = [m | {"content": [_marked(p, marks) for p in m["content"]]} for m in messages]
        pieces = self.render_chat(
            messages, tools, template_kwargs, add_generation_prompt, continue_final_message
        ).split(IMAGE if self.tiling is None else self.tiling.marker)
        if len(pieces) != len(images) + 1:
            raise TemplateError(f"the chat template wrote {len(pieces) - 1} images for {len(images)}")
        literals = [p["text"] for p in texts]
        ids, starts = [], []
        for k, piece in enumerate(pieces):
            ids += (
                self._with_literals(_MARK.split(piece), literals)
                if literal
                else _encode(self.backend, piece, False)
            )
            if k < len(images):
                starts.append(len(ids))
                ids += images[k]
        return ids, starts

    def detokenizer(self, prompt_token_ids: list[int], special_tokens: bool = False) -> Detokenizer:
        """`special_tokens`: keep them in the text (a style that reads them: harmony's markers)."""
        return Detokenizer(self.backend, prompt_token_ids, special_tokens)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """The vocabulary's own strings of `ids` (byte-level: "Ġworld" for " world"). A list
        lookup per id in a table of the whole vocabulary, made on first use: the GIL is
        held 21 ms for the 784k ids of a 900k-character prompt, against 132 ms for a
        tokenizer call per id (the table: 35 ms once, for SmolLM2's 49k; a short list, which
        may be answered on the event loop, does not make it)."""
        b, table = self.backend, self._vocab_strs
        if table is None and len(ids) <= _STRS_ONE_BY_ONE:
            return [b.id_to_token(t) for t in ids]
        if table is None:
            table = self._vocab_strs = [
                b.id_to_token(i) for i in range(b.get_vocab_size(with_added_tokens=True))
            ]
        try:
            return [table[t] for t in ids]
        except IndexError:  # an id past the table (a sparse added token): one by one
            return [b.id_to_token(t) for t in ids]

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (cached: the same few ids come back often)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 65536:
                self._token_text[token_id] = text
        return text


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode`, which holds the GIL throughout (seconds for a megabyte: on a
    thread it still stops the event loop), or for a long text `encode_batch_fast`, which
    releases it: the same ids. Not `encode_batch`: it releases the GIL while it encodes but
    takes it back to hand over the encoding's offsets (a 118-229 ms hold for 900k characters
    here, every stream of the engine stopped; `encode_batch_fast` computes no offsets: no
    hold over 20 ms)."""
    if len(text) <= _GIL_FREE_ABOVE:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # tokenizers >= 0.21
    return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)


class Detokenizer:
    """Token ids in, text deltas out, for one choice of one request."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: Tokenizer, prompt_token_ids: list[int], special_tokens: bool = False) -> None:
        self._backend = backend
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=not special_tokens
        )

    def feed(self, token_ids: list[int]) -> str:
        """Text completed by these tokens; "" while a character is still partial."""
        if not token_ids:
            return ""
        try:
            return self._stream.step(self._backend, list(token_ids)) or ""
        except Exception:  # an id out of the vocabulary: the engine and tokenizer disagree
            log.exception("cannot decode token ids %s", token_ids)
            raise


class StopMatcher:
    """Finds stop strings in streamed text. Text that could still be the start of a
    stop string is held back until the next delta settles it."""

    __slots__ = ("_stops", "_firsts", "_held", "_longest", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._firsts = {s[0] for s in self._stops}
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        #: the stop string that ended the text (Anthropic's `stop_sequence` names it)
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string matched). After a
        match, the text before the stop string is returned and the rest dropped.
        The earliest-starting stop string wins, however the text was split: a match
        waits while an earlier-starting one could still complete."""
        buf = self._held + text
        hit, stop = self._first_match(buf)
        start = len(buf) - self._partial_suffix(buf)  # where a still-open match begins
        if 0 <= hit <= start:
            self._held, self.matched = "", stop
            return buf[:hit], True
        self._held = buf[start:]
        return buf[:start], False

    def flush(self) -> tuple[str, bool]:
        """At the end of the stream: the held text, cut at a stop string that was
        waiting on an earlier, longer one that never completed."""
        buf, self._held = self._held, ""
        hit, stop = self._first_match(buf)
        if hit < 0:
            return buf, False
        self.matched = stop
        return buf[:hit], True

    def _first_match(self, buf: str) -> tuple[int, str | None]:
        """Where the earliest stop string starts in `buf` and which it is (the first
        listed on a tie); (-1, None) when none does."""
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        return min(hits, key=lambda h: h[0]) if hits else (-1, None)

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for pos in range(max(0, len(buf) - self._longest + 1), len(buf)):
            if buf[pos] in self._firsts and any(s.startswith(buf[pos:]) for s in self._stops):
                return len(buf) - pos  # the earliest start is the longest suffix
        return 0
