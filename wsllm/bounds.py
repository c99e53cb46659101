"""Every bound of a wire message's numbers, declared once (`SAMPLING_BOUNDS`,
`REQUEST_BOUNDS`: a `Bound` each), the limits more than one table uses, and the checks
that read them (`Bound.check`, `check_structured_shape`). The types they bound are in
types.py, which runs these checks on construction; the gateway's request schema
(server/fields.py) and the chat UI (through the WebSocket hello's `bounds`) read the same
declarations. Imports nothing of wsllm: types.py stands on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

# Strict decoding: no "0.5" for a number, no 1.0 or true for an integer, no NaN, no
# field the type does not have. (pydantic reads this from the dataclasses.)
STRICT_DECODING = {
    "strict": True,
    "extra": "forbid",
    "allow_inf_nan": False,
    "revalidate_instances": "always",
}

# -- bounds: the numbers that more than one table uses --------------------------------------

MAX_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20  # -1 (off) or 1..MAX_TOP_K; the engine clamps it to its vocabulary
MAX_TOKEN_ID = 2**31 - 1  # token ids are in [0, MAX_TOKEN_ID]; the vocabulary is checked later
MAX_PROMPT_TOKENS = 1 << 20
MAX_ID_CHARS = 256  # request ids, model and tenant names
#: a request's `cache_salt` (vLLM's) and an operator's per-tenant salt, each
MAX_CACHE_SALT_CHARS = 256
#: GenerateRequest.cache_salt: the gateway's namespace, "<tenant's>\x1f<request's>"
MAX_WIRE_SALT_CHARS = 2 * MAX_CACHE_SALT_CHARS + 16
#: a request's images on the wire (GenerateRequest.images): at most this many, and this
#: many bytes of their files all told (base64 on the wire: 4/3 of it). The gateway's
#: --max-request-image-bytes is at most this; a Redis stream entry is bounded by it.
MAX_WIRE_IMAGES = 64
MAX_WIRE_IMAGE_BYTES = 64 << 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's cap)
LOGIT_BIAS_LIMIT = 100.0  # each bias is in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], as OpenAI's
#: the kinds of `structured` output, each the one key of its dict (see wsllm/structured.py)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
MAX_STRUCTURED_BYTES = 1 << 17  # a structured spec, as JSON
MAX_CHOICES = 1024  # strings of a structured {"choice": [...]}


def check(cond: bool, field_name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _Summary(str):
    def __repr__(self) -> str:
        return str(self)


def summary(ids: object) -> object:
    """A long list (or map) shown by its length in an error message."""
    if isinstance(ids, (list, dict)) and len(ids) > 8:
        return _Summary(f"a {'list' if isinstance(ids, list) else 'map'} of {len(ids)} items")
    return ids


def check_structured_shape(spec: object) -> None:
    """ValueError naming the field when `spec` is not one of the `structured` shapes (see
    SamplingParams.structured). Whether its schema, regex or grammar compiles is not
    checked here (wsllm.structured.check_spec does that)."""
    kinds = " | ".join(STRUCTURED_KINDS)
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        keys = list(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"structured must be an object with exactly one key of {kinds}, got {keys!r}")
    kind, value = next(iter(spec.items()))
    where = f"structured.{kind}"
    if kind == "json":
        ok, allowed = value is True or isinstance(value, dict), "a JSON schema object or true"
    elif kind == "choice":
        ok = isinstance(value, list) and 1 <= len(value) <= MAX_CHOICES
        ok = ok and all(isinstance(c, str) and c for c in value)
        allowed = f"a list of 1 to {MAX_CHOICES} non-empty strings"
    else:
        ok, allowed = isinstance(value, str) and value != "", "a non-empty string"
    check(ok, where, allowed, summary(value))
    try:
        size = len(orjson.dumps(value))
    except TypeError as e:  # a key that is not a string, an object JSON has no word for
        raise ValueError(f"{where} must be plain JSON: {e}") from None
    most = f"at most {MAX_STRUCTURED_BYTES} bytes as JSON"
    check(size <= MAX_STRUCTURED_BYTES, where, most, _Summary(f"{size} bytes"))


def token_ids_ok(ids: object, max_len: int, min_len: int = 0) -> bool:
    if not isinstance(ids, list) or not min_len <= len(ids) <= max_len:
        return False
    if not all(is_int(t) for t in ids):
        return False
    return not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID)


@dataclass(frozen=True, slots=True)
class Bound:
    """The range of one number of a wire message, declared once (SAMPLING_BOUNDS,
    REQUEST_BOUNDS) and read by the message's own checks, the gateway's request schema
    (its 400s) and, through the WebSocket hello's `bounds`, the chat UI."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False  # lo itself is out
    hi_open: bool = False  # hi itself is out
    nullable: bool = False  # None is allowed (on the wire; in a request None is "the default")
    off: int | None = None  # one more value, below lo, that turns the parameter off (top_k's -1)
    api_hi: float | None = None  # a request's tighter upper end (temperature: OpenAI's 2)
    items: int | None = None  # a list of at most this many values in range
    keyed: bool = False  # with `items`: a map from token ids to values in range

    def holds(self, v: Any) -> bool:
        """One value (not a list) is in range."""
        if not (is_int(v) if self.integer else is_num(v)):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        return v == self.off or (above and (v < self.hi if self.hi_open else v <= self.hi))

    def check(self, name: str, v: Any) -> None:
        """ValueError naming the field and its range when `v` is out of it."""
        if v is None or self.items is None:
            ok = self.nullable if v is None else self.holds(v)
        elif self.keyed:
            ok = isinstance(v, dict) and all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v)
            ok = ok and len(v) <= self.items and all(self.holds(x) for x in v.values())
        else:
            ok = isinstance(v, list) and len(v) <= self.items and all(self.holds(x) for x in v)
        if not ok:  # the message only when it is needed: this runs for every field of every request
            raise ValueError(f"{name} must be {self.describe()}, got {summary(v)!r}")

    def describe(self) -> str:
        span = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        one = f"{'an integer' if self.integer else 'a number'} in {span}"
        if self.keyed:
            one = f"a map of at most {self.items} token ids in [0, {MAX_TOKEN_ID}] to numbers in {span}"
        elif self.items is not None:
            one = f"a list of at most {self.items} {'integers' if self.integer else 'numbers'} in {span}"
        elif self.off is not None:
            one = f"{self.off} (off) or {one}"
        return f"null or {one}" if self.nullable else one


#: Every bound of SamplingParams, each declared here once. Its keys are SamplingParams'
#: fields; a request's max_completion_tokens, top_logprobs and a completion's logprobs
#: take the bound of max_tokens and logprobs.
SAMPLING_BOUNDS: dict[str, Bound] = {
    "n": Bound(1, 128, integer=True),
    "max_tokens": Bound(1, MAX_TOKENS, integer=True),
    "min_tokens": Bound(0, MAX_TOKENS, integer=True),  # and at most max_tokens
    "temperature": Bound(0.0, 100.0, api_hi=2.0),  # a request: OpenAI's [0, 2]
    "top_p": Bound(0.0, 1.0, lo_open=True),
    "top_k": Bound(1, MAX_TOP_K, integer=True, off=-1),
    "min_p": Bound(0.0, 1.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 2.0, lo_open=True),
    "seed": Bound(0, 2**63, integer=True, hi_open=True, nullable=True),
    "stop_token_ids": Bound(0, MAX_TOKEN_ID, integer=True, items=64),
    "logprobs": Bound(0, 20, integer=True, nullable=True),  # top logprobs per token
    "prompt_logprobs": Bound(0, 20, integer=True, nullable=True),
    "beam_width": Bound(1, 16, integer=True),
    "length_penalty": Bound(-10.0, 10.0),
    "logit_bias": Bound(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT, items=MAX_LOGIT_BIAS, keyed=True, nullable=True),
}
BEAM_ALONE = "structured and logit_bias cannot be combined with use_beam_search"


#: The bounds of GenerateRequest's numbers (the gateway's schema takes `priority`'s).
REQUEST_BOUNDS: dict[str, Bound] = {
    "arrival_time": Bound(0.0, 1e12),  # time.time()
    "queue_deadline": Bound(0.0, 1e12),
    "priority": Bound(-1_000_000, 1_000_000, integer=True),
}
