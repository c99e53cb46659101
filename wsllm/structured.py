"""Structured output: a `SamplingParams.structured` spec turned into an llguidance grammar.

Shared by the gateway and the engine, and torch-free (llguidance's core is Rust):
- `check_spec(spec)`: ValueError with a clear message when the schema, regex or grammar
  cannot be compiled, so that the gateway answers 400 naming the problem;
- `grammar_for(spec)`: the llguidance grammar of a spec;
- `Matchers`: the engine's factory of per-sequence matchers, compiling on a helper
  thread (never the engine's step thread). It builds llguidance's index of the
  tokenizer (about a second, and 100+ MB resident for the rest of the process) once,
  when the first structured request arrives (or at start, with `index_at_start`), and
  keeps the last compiled specs so that a repeated schema costs a copy, not a compile;
- the gateway runs `check_spec` in a process of its check pool, with a deadline
  (wsllm/server/programs.py).

What a spec accepts is in docs/protocol.md ("Structured output").
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llguidance
import orjson
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from wsllm.bounds import check_structured_shape
from wsllm.priority import lower_priority

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
    """One engine's source of llguidance matchers, one per sequence. Compiling happens
    on a helper thread of its own (`start` hands back a Future): the tokenizer's index
    (seconds), each spec's compile (milliseconds, or hundreds for a large one) and the
    cache of compiled specs all live there, so the engine's step thread never waits on
    them and every stream of the engine goes on while a unique schema compiles. One
    thread: a flood of unique schemas queues behind itself (each request bounded by the
    engine's deadline), not beside the model on every core."""

    def __init__(
        self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int], index_at_start: bool = False
    ) -> None:
        self.model_dir = str(model_dir)
        # False: `warm` leaves the index to the first structured request, so that a server
        # nobody asks for structured output does not hold it (EngineConfig.structured_index_at_start)
        self.index_at_start = index_at_start
        self.vocab_size = vocab_size  # the model's logits width, which masks cover
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self._warmed = False
        self._compiled: OrderedDict[bytes, LLMatcher] = OrderedDict()  # spec -> a fresh matcher
        # Runtime errors say what failed, without a dump of the parser's state.
        self._limits = LLParserLimits(verbose_errors=False)
        # below the engine's threads: a unique schema's compile is its own request's wait,
        # not a stall of every running stream's step on a machine with few cores
        self._pool = ThreadPoolExecutor(
            1, "wsllm-llguidance", initializer=lower_priority, initargs=(COMPILE_NICE, "grammar compiles")
        )

    def warm(self) -> None:
        """Servers call this once the model is loaded. With `index_at_start`, build the
        tokenizer's index on the helper thread now, so that the first structured request
        does not wait for it; without, only make the later build safe beside the gateway's
        threads (the first structured request then waits for the build, and the other
        streams see one pause of a few hundred ms while it holds the GIL)."""
        if not self._warmed:
            self._warmed = True
            # transformers resolves its names lazily, and not safely from two threads at
            # once: resolve here the ones this and the gateway's tokenizers use.
            import llguidance.hf  # noqa: F401
            import transformers

            _ = transformers.PreTrainedTokenizerFast
            if self.index_at_start:
                self._pool.submit(self._build)

    def start(self, spec: Any) -> Future[LLMatcher]:
        """A matcher at the start of `spec`'s grammar, compiled on the helper thread: the
        Future raises ValueError naming the problem when the spec does not compile (or
        the model's tokenizer cannot be read). Cancel it to drop a compile not begun."""
        return self._pool.submit(self._new, spec)

    def new(self, spec: Any) -> LLMatcher:
        """`start(spec)`, waited for: for callers with nothing else to do meanwhile."""
        return self.start(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer_now(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer (on the helper thread). Every id in
        `eos_token_ids` ends a grammar that is complete."""
        self._build()
        if self._tokenizer is None:
            raise ValueError(self._tokenizer_error)
        return self._tokenizer

    def _build(self) -> None:
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                import llguidance.hf

                # The gateway's class (tokenizer.json and its added tokens), not AutoTokenizer:
                # the same vocabulary, without importing transformers' auto classes (tens of MB).
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(  # a slow tokenizer: ValueError
                    hf,  # type: ignore[arg-type]
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            except Exception as e:  # noqa: BLE001 - say why structured output is off here
                log.exception("structured output: cannot load the tokenizer of %s", self.model_dir)
                self._tokenizer_error = f"structured output is not available for this model: {e}"

    def _new(self, spec: Any) -> LLMatcher:
        key = _canonical(spec)
        fresh = self._compiled.get(key)
        if fresh is None:
            grammar = grammar_for(spec)
            fresh = LLMatcher(self._tokenizer_now(), grammar, log_level=0, limits=self._limits)
            if fresh.is_error():
                raise ValueError(f"structured.{next(iter(spec))}: {_cut(fresh.get_error())}")
            self._compiled[key] = fresh
            if len(self._compiled) > _CACHED_SPECS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return fresh.deep_copy()


class PendingCompiles:
    """The engine's requests whose matcher is compiling (`Matchers.start`), each with
    its deadline. The step thread polls them; it waits only when it has nothing else to
    run, so that an idle engine does not spin while a spec compiles."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # request id -> (compile, deadline, when it ended: filled by the compile's thread)
        self._pending: dict[str, tuple[Future[LLMatcher], float, list[float]]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, compiling: Future[LLMatcher]) -> None:
        ended: list[float] = []
        compiling.add_done_callback(lambda _: ended.append(time.monotonic()))
        self._pending[request_id] = (compiling, time.monotonic() + self.timeout_s, ended)

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted): its compile is dropped if it has not begun."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()

    def poll(self, wait_s: float = 0.0) -> tuple[list[tuple[str, LLMatcher]], list[tuple[str, str]]]:
        """(request id, matcher) of the compiles done, and (request id, why) of those that
        failed or passed their deadline; waits up to `wait_s` for one to end."""
        if wait_s > 0 and self._pending:
            futures.wait([f for f, _, _ in self._pending.values()], wait_s, futures.FIRST_COMPLETED)
        ready: list[tuple[str, LLMatcher]] = []
        failed: list[tuple[str, str]] = []
        now = time.monotonic()
        for rid, (compiling, deadline, ended) in list(self._pending.items()):
            # A compile judged by when it ended, not when the step thread looked: a spec
            # that ended past its deadline is late however soon it is polled.
            late = now >= deadline if not (compiling.done() and ended) else ended[0] > deadline
            if late:
                self.drop(rid)
                failed.append(
                    (rid, f"structured output: the spec did not compile within {self.timeout_s:g}s")
                )
            elif compiling.done():
                del self._pending[rid]
                try:
                    ready.append((rid, compiling.result()))
                except ValueError as e:
                    failed.append((rid, str(e)))
                except Exception as e:  # noqa: BLE001 - llguidance failing is this request's failure
                    log.exception("structured output: compiling a spec failed")
                    failed.append((rid, f"structured output failed to compile: {e}"))
        return ready, failed


__all__ = ["JSON_DEFAULTS", "Matchers", "PendingCompiles", "check_spec", "grammar_for"]


#: how far below the engine's threads its grammar compiles run (Linux: a nice per thread)
COMPILE_NICE = 10
