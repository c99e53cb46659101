"""Structured output: a `SamplingParams.structured` spec turned into an llguidance grammar.

Shared by the gateway and the engine, and torch-free (llguidance's core is Rust):
- `check_spec(spec)`: ValueError with a clear message when the schema, regex or grammar
  cannot be compiled, so that the gateway answers 400 naming the problem;
- `grammar_for(spec)`: the llguidance grammar of a spec;
- `Matchers`: the engine's factory of per-sequence matchers. It builds the tokenizer
  (about a second) the first time a structured request arrives, and keeps the last
  compiled specs so that a repeated schema costs a copy, not a compile.

What a spec accepts is in docs/protocol.md ("Structured output").
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llguidance
import orjson
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from wsllm.types import check_structured_shape

log = logging.getLogger(__name__)

#: JSON is written compactly (no whitespace between tokens): a model cannot pad its
#: output with endless blank lines. A schema's "x-guidance" object overrides this
#: (e.g. {"whitespace_flexible": true}), as llguidance reads it after these defaults.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 600  # an llguidance message, cut to a length a client can read
_CACHED_SPECS = 64  # compiled matchers kept per engine


def _cut(msg: str) -> str:
    msg = msg.replace("<non-verbose/>", "").strip()
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[:MAX_ERROR_CHARS] + " ..."


def grammar_for(spec: Any) -> str:
    """The llguidance grammar for `spec` (one of SamplingParams.structured's shapes).
    ValueError when the spec has the wrong shape or cannot even be parsed (a GBNF
    grammar that does not convert); whether it compiles is `check_spec`'s question."""
    check_structured_shape(spec)
    kind, value = next(iter(spec.items()))
    try:
        if kind == "json":
            schema = {"type": "object"} if value is True else value
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
        if kind == "regex":
            return LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", value)
        return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured.{kind}: {_cut(str(e))}") from None


def check_spec(spec: Any) -> None:
    """ValueError naming the problem when `spec` is not a structured-output spec the
    engine can serve: a wrong shape, an invalid or unsupported JSON schema (unknown
    keywords, `not`, an unsatisfiable range), a regex or grammar that does not compile.
    Cheap (no tokenizer): milliseconds for ordinary schemas."""
    grammar = grammar_for(spec)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"structured.{next(iter(spec))}: {_cut(messages[0])}")


def _canonical(spec: Any) -> bytes:
    return orjson.dumps(spec, option=orjson.OPT_SORT_KEYS)


class Matchers:
    """One engine's source of llguidance matchers, one per sequence. Not thread-safe
    (the engine's one thread uses it)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size  # the model's logits width, which masks cover
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._warming: threading.Thread | None = None
        self._compiled: OrderedDict[bytes, LLMatcher] = OrderedDict()  # spec -> a fresh matcher
        # Runtime errors say what failed, without a dump of the parser's state.
        self._limits = LLParserLimits(verbose_errors=False)

    def warm(self) -> None:
        """Build the tokenizer's index on a thread of its own now, so that the first
        structured request does not stop every stream of the engine while it is built
        (seconds for a 49k vocabulary on 2 cores). Servers call this once the model is
        loaded; tests that never ask for structured output leave it."""
        if self._tokenizer is None and self._warming is None:
            # transformers resolves its names lazily, and not safely from two threads at
            # once: resolve here the ones this and the gateway's tokenizers use.
            import llguidance.hf  # noqa: F401
            import transformers

            _ = transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast
            self._warming = threading.Thread(target=self._build, name="wsllm-llguidance-warm", daemon=True)
            self._warming.start()

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer, built on first use (or by
        `warm`). Every id in `eos_token_ids` ends a grammar that is complete."""
        if self._warming is not None:
            self._warming.join()  # at most what is left of the build
            self._warming = None
        if self._tokenizer is None:
            self._build()
        if self._tokenizer is None:
            raise ValueError(self._tokenizer_error)
        return self._tokenizer

    def _build(self) -> None:
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(  # a slow tokenizer: ValueError
                    hf,  # type: ignore[arg-type]
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            except Exception as e:  # noqa: BLE001 - say why structured output is off here
                log.exception("structured output: cannot load the tokenizer of %s", self.model_dir)
                self._tokenizer_error = f"structured output is not available for this model: {e}"

    def new(self, spec: Any) -> LLMatcher:
        """A matcher at the start of `spec`'s grammar; ValueError naming the problem
        when the spec does not compile."""
        key = _canonical(spec)
        fresh = self._compiled.get(key)
        if fresh is None:
            grammar = grammar_for(spec)
            fresh = LLMatcher(self.tokenizer(), grammar, log_level=0, limits=self._limits)
            if fresh.is_error():
                raise ValueError(f"structured.{next(iter(spec))}: {_cut(fresh.get_error())}")
            self._compiled[key] = fresh
            if len(self._compiled) > _CACHED_SPECS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return fresh.deep_copy()


__all__ = ["JSON_DEFAULTS", "Matchers", "check_spec", "grammar_for"]
