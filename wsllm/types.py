"""Wire types shared by the gateway, the broker and the engine.

Plain dataclasses, encoded with orjson and a schema version. No torch here: the
gateway imports this module and must stay light. Nothing is ever pickled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

SCHEMA_VERSION = 1

# Finish reasons, as OpenAI spells them, plus our own.
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the model's context
FINISH_ABORT = "abort"  # cancelled by the client or the gateway
FINISH_ERROR = "error"  # the engine could not serve it (see TokenEvent.error)


def _check(cond: bool, field_name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. Validated on construction; a bad field raises ValueError
    whose message names the field and the allowed range."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = chosen only
    # Beam search (issue 6); off by default.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]", self.n)
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "an integer in [0, max_tokens]",
            self.min_tokens,
        )
        _check(
            _is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            "a finite number in [0, 100]",
            self.temperature,
        )
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int)
            and not isinstance(self.top_k, bool)
            and self.top_k >= -1
            and self.top_k != 0,
            "top_k",
            "-1 (off) or an integer >= 1",
            self.top_k,
        )
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2.0 <= v <= 2.0, name, "a finite number in [-2, 2]", v)
        _check(
            _is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            "in (0, 2]",
            self.repetition_penalty,
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "null or an integer in [0, 2**63)",
            self.seed,
        )
        _check(
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
            self.stop_token_ids,
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            "null or an integer in [0, 20]",
            self.logprobs,
        )
        _check(
            isinstance(self.beam_width, int) and 1 <= self.beam_width <= 16,
            "beam_width",
            "an integer in [1, 16]",
            self.beam_width,
        )
        _check(_is_num(self.length_penalty), "length_penalty", "a finite number", self.length_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)


@dataclass(slots=True)
class GenerateRequest:
    """A request as it travels from a gateway to an engine: token ids only."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str = ""
    reply_to: str = ""  # the gateway (result stream) that waits for the events
    arrival_time: float = 0.0  # time.time() at the gateway
    skip_tokens: int = 0  # resume: tokens the client already has (per choice)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenEvent:
    """New tokens for one choice of one request, produced by one engine step.

    `seq` counts the events of (request_id, index) from 0, so a consumer can spot
    a gap or a duplicate. The last event of a choice has `finish_reason` set.
    """

    request_id: str
    seq: int
    token_ids: list[int]
    index: int = 0  # the choice (n > 1)
    finish_reason: str | None = None
    # per new token: [chosen_logprob, [[token_id, logprob], ...top-N]]
    logprobs: list[Any] | None = None
    usage: Usage | None = None  # set on the final event
    error: str | None = None  # human-readable, when finish_reason == "error"
    error_code: str | None = None  # machine-readable, e.g. "worker_lost"
    queue_time: float | None = None  # seconds between arrival and first schedule (seq 0)


def encode(obj: GenerateRequest | TokenEvent | list[TokenEvent]) -> bytes:
    """One codec for everything that crosses a process."""
    if isinstance(obj, list):
        return orjson.dumps({"v": SCHEMA_VERSION, "kind": "events", "items": [asdict(e) for e in obj]})
    kind = "request" if isinstance(obj, GenerateRequest) else "event"
    return orjson.dumps({"v": SCHEMA_VERSION, "kind": kind, "item": asdict(obj)})


def _event_from(d: dict[str, Any]) -> TokenEvent:
    usage = d.get("usage")
    d = dict(d, usage=Usage(**usage) if usage else None)
    return TokenEvent(**d)


def decode(data: bytes | str) -> GenerateRequest | TokenEvent | list[TokenEvent]:
    msg = orjson.loads(data)
    if msg.get("v") != SCHEMA_VERSION:
        raise ValueError(f"wire schema version {msg.get('v')!r} is not {SCHEMA_VERSION}")
    kind = msg.get("kind")
    if kind == "events":
        return [_event_from(d) for d in msg["items"]]
    if kind == "event":
        return _event_from(msg["item"])
    if kind == "request":
        d = dict(msg["item"])
        d["params"] = SamplingParams.from_dict(d["params"])
        return GenerateRequest(**d)
    raise ValueError(f"unknown wire message kind {kind!r}")
