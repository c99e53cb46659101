"""Wire types shared by the gateway, the broker and the engine, and the event
vocabulary they speak (finish reasons, error codes, whole-request events).

Plain dataclasses, encoded with orjson and a schema version. No torch here: the
gateway imports this module and must stay light. Nothing is ever pickled.

The codec is wsllm/wire.py: decoding is strict, and a bad entry raises `WireError`
naming the field, so that it costs its own request and nothing else. Every bound of a
number is declared once, in wsllm/bounds.py (SAMPLING_BOUNDS, REQUEST_BOUNDS), and checked
here on construction; the gateway's validator (server/schemas.py) and the UI (through the
WebSocket hello) read the same declaration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from wsllm.bounds import (
    BEAM_ALONE,
    MAX_ID_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    MAX_WIRE_IMAGE_BYTES,
    MAX_WIRE_IMAGES,
    MAX_WIRE_SALT_CHARS,
    REQUEST_BOUNDS,
    SAMPLING_BOUNDS,
    STRICT_DECODING,
    check,
    check_structured_shape,
    summary,
    token_ids_ok,
)
from wsllm.prompt_image import PromptImage

SCHEMA_VERSION = 1

# -- the event vocabulary ---------------------------------------------------------------

# Finish reasons, as OpenAI spells them, plus our own.
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the model's context
FINISH_ABORT = "abort"  # cancelled by the client or the gateway
FINISH_ERROR = "error"  # the engine could not serve it (see TokenEvent.error_code)

# Error codes: TokenEvent.error_code, and the `code` of errors on every transport.
ERR_INVALID_REQUEST = "invalid_request"  # refused: the request can never be served as it is
ERR_ENGINE_BUSY = "engine_busy"  # refused for now: a retry may succeed
ERR_INTERNAL = "internal_error"  # the engine failed while serving it
ERR_WORKER_LOST = "worker_lost"  # the engine (or the broker's copy of the request) went away
ERR_SLOW_CONSUMER = "slow_consumer"  # the client fell too far behind its own stream
ERR_RESUMED_ELSEWHERE = "resumed_elsewhere"  # its owner resumed it on another connection
ERR_QUEUE_TIMEOUT = "queue_timeout"  # it waited for an engine past its queue deadline
ERR_RATE_LIMITED = "rate_limited"  # refused at admission: the tenant is over a limit (gateway only)
ERR_ENGINE_STALLED = "engine_stalled"  # its engine made no progress for --stall-timeout-s (a retry may pass)

#: TokenEvent.index of an event about the whole request, not one choice of it
WHOLE_REQUEST = -1

# -- sampling ---------------------------------------------------------------------------

#: temperatures below this sample greedily, as vLLM does: dividing logits by 1e-300
#: would turn them into inf and NaN
GREEDY_BELOW = 1e-5
#: SamplingParams.pooling: how an embedding request's last hidden states become one vector
#: ("auto": the engine's choice for its model, EngineConfig.pooling)
POOLING_KINDS = ("auto", "last", "mean")


class WireError(ValueError):
    """A message that is not a valid wire message; the text names the field."""


class EngineBusy(ValueError):
    """The engine cannot take a request now (it is full); a retry later may succeed.
    The worker reports it as `engine_busy`, which the gateway answers with 503."""


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. Validated on construction; a bad field raises ValueError
    whose message names the field and the allowed range."""

    __pydantic_config__ = STRICT_DECODING

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # below GREEDY_BELOW: greedy
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
    # Logprobs of the prompt's tokens (top N each, 0 = the prompt token's only), computed
    # during prefill and returned once: TokenEvent.prompt_logprobs. None: not computed.
    prompt_logprobs: int | None = None
    # Beam search (issue 6); off by default.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    # Structured output (issue 13): exactly one of {"json": <JSON schema> or true (any JSON
    # object)}, {"regex": str}, {"choice": [str, ...]}, {"grammar": str (Lark or GBNF)}.
    # Its shape is checked here; whether the schema / regex / grammar compiles is checked
    # by wsllm.structured.check_spec (the gateway) and again by the engine.
    structured: dict[str, Any] | None = None
    # OpenAI's logit_bias: token id -> a bias added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    # An embedding request (issue 25) when set, one of POOLING_KINDS: the engine runs the
    # prompt's prefill only, never samples, and returns the pooled last hidden state (after
    # the final norm) on the final TokenEvent's `embedding`. The other fields are ignored.
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name, bound in SAMPLING_BOUNDS.items():
            bound.check(name, getattr(self, name))
        fits = self.min_tokens <= self.max_tokens
        check(fits, "min_tokens", "an integer in [0, max_tokens]", self.min_tokens)
        for name in ("ignore_eos", "use_beam_search", "early_stopping"):
            check(isinstance(getattr(self, name), bool), name, "a boolean", getattr(self, name))
        if self.structured is not None:
            check_structured_shape(self.structured)
        if self.use_beam_search and (self.structured is not None or self.logit_bias):
            raise ValueError(BEAM_ALONE)
        if self.pooling is not None:
            check(self.pooling in POOLING_KINDS, "pooling", f"null or one of {POOLING_KINDS}", self.pooling)
            alone = self.n == 1 and not self.use_beam_search and self.structured is None
            check(
                alone, "pooling", "set only with n = 1, no beam search and no structured output", self.pooling
            )

    @property
    def needs_every_position(self) -> bool:
        """Every prompt position must be computed here (no prefix-cache hits): its
        prompt logprobs, or a mean over its hidden states."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class GenerateRequest:
    """A request as it travels from a gateway to an engine: token ids only."""

    __pydantic_config__ = STRICT_DECODING

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str = ""
    arrival_time: float = 0.0  # time.time() at the gateway
    #: time.time() after which it must not start (0: no deadline); set by the gateway
    #: from --queue-timeout-s, enforced by whoever holds it then (broker or engine)
    queue_deadline: float = 0.0
    priority: int = 0  # higher is admitted first; the gateway caps it per tenant
    tenant: str = ""  # who asked (set by the gateway from the API key): fair sharing
    #: the prefix cache namespace its blocks are shared in (set by the gateway: its
    #: tenant's salt, narrowed by the request's own `cache_salt`); "" the common one.
    #: The engine and prefix routing read it through `prefix_hash.request_root`.
    cache_salt: str = ""
    lora: str = ""  # the LoRA adapter it runs under (a name its engines hold; "": the base)
    #: its images, in prompt order, each span within the prompt and apart from the others
    images: list[PromptImage] = field(default_factory=list)

    def expired(self, now: float) -> bool:
        """Past its queue deadline at `now` (time.time()): it must not start."""
        return 0.0 < self.queue_deadline <= now

    def __post_init__(self) -> None:
        for name, least, most in (
            ("request_id", 1, MAX_ID_CHARS),
            ("model", 0, MAX_ID_CHARS),
            ("tenant", 0, MAX_ID_CHARS),
            ("cache_salt", 0, MAX_WIRE_SALT_CHARS),
            ("lora", 0, MAX_ID_CHARS),
        ):
            v = getattr(self, name)
            ok = isinstance(v, str) and least <= len(v) <= most
            check(ok, name, f"a string of {least} to {most} characters", v)
        check(
            token_ids_ok(self.prompt_token_ids, MAX_PROMPT_TOKENS, min_len=1),
            "prompt_token_ids",
            f"a list of 1 to {MAX_PROMPT_TOKENS} token ids in [0, {MAX_TOKEN_ID}]",
            summary(self.prompt_token_ids),
        )
        check(isinstance(self.params, SamplingParams), "params", "SamplingParams", type(self.params))
        for name, bound in REQUEST_BOUNDS.items():
            bound.check(name, getattr(self, name))
        self._check_images()

    def _check_images(self) -> None:
        ims = self.images
        ok = (
            isinstance(ims, list)
            and len(ims) <= MAX_WIRE_IMAGES
            and all(isinstance(i, PromptImage) for i in ims)
        )
        check(ok, "images", f"a list of at most {MAX_WIRE_IMAGES} images", summary(ims))
        total = sum(i.file_bytes for i in ims)
        check(
            total <= MAX_WIRE_IMAGE_BYTES, "images", f"at most {MAX_WIRE_IMAGE_BYTES} bytes of files", total
        )
        end = 0
        for k, im in enumerate(ims):
            inside = end <= im.start and im.start + im.length <= len(self.prompt_token_ids)
            check(
                inside,
                f"images.{k}",
                "a span within the prompt, after the image before it",
                (im.start, im.length),
            )
            end = im.start + im.length


@dataclass(slots=True)
class Usage:
    __pydantic_config__ = STRICT_DECODING

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding: draft tokens the request's choices verified, and of them accepted
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenEvent:
    """New tokens for one choice of one request, produced by one engine step.

    `seq` counts the events of (request_id, index) from 0, so a consumer can spot
    a gap or a duplicate. The last event of a choice has `finish_reason` set. An
    event with `index == WHOLE_REQUEST` is about the whole request (`abort_marker`,
    `failure`); `ends_request` says whether an event ends every choice at once.
    """

    __pydantic_config__ = STRICT_DECODING

    request_id: str
    seq: int
    token_ids: list[int]
    index: int = 0  # the choice (n > 1), or WHOLE_REQUEST
    finish_reason: str | None = None
    # per new token: [chosen_logprob, [[token_id, logprob], ...top-N]]
    logprobs: list[Any] | None = None
    usage: Usage | None = None  # set on the final event
    error: str | None = None  # human-readable, when finish_reason == "error"
    error_code: str | None = None  # machine-readable, one of the ERR_* codes
    queue_time: float | None = None  # seconds between arrival and first schedule (seq 0)
    # Once per request (params.prompt_logprobs set), on the first event after its prompt is
    # computed: per prompt token, None for the first, else (logprob, ((token_id, logprob), ...))
    # (lists once it has crossed a process: JSON has no tuples).
    # Left out of the encoding when None, so a peer that predates it still reads the event.
    prompt_logprobs: list[Any] | None = None
    # An embedding request's pooled vector (fp32 values, not normalized), on its final
    # event. Left out of the encoding when None, as prompt_logprobs.
    embedding: list[float] | None = None

    @classmethod
    def failure(cls, request_id: str, code: str, message: str, seq: int = -1) -> TokenEvent:
        """The request failed as a whole: its last event."""
        return cls(request_id, seq, [], WHOLE_REQUEST, FINISH_ERROR, error=message, error_code=code)

    @classmethod
    def lost(cls, request_id: str, why: str, seq: int = -1) -> TokenEvent:
        """The request's engine, or the broker's copy of it, went away."""
        return cls.failure(request_id, ERR_WORKER_LOST, why, seq)

    @classmethod
    def abort_marker(cls, request_id: str) -> TokenEvent:
        """A gateway cancelled the whole request (written to its result stream)."""
        return cls(request_id, -1, [], WHOLE_REQUEST, FINISH_ABORT)

    @property
    def whole_request(self) -> bool:
        return self.index < 0

    @property
    def ends_request(self) -> bool:
        """This event ends every choice: a failure, or a whole-request abort."""
        return self.finish_reason == FINISH_ERROR or (self.whole_request and self.finish_reason is not None)


@dataclass(slots=True)
class EngineInfo:
    """What an engine worker tells the gateways about itself, refreshed by heartbeats
    (through the broker: JSON on Redis)."""

    engine_id: str
    model: str
    max_model_len: int
    #: other names the model answers to (`--model-name A --model-name B`: B)
    aliases: list[str] = field(default_factory=list)
    #: the LoRA adapters it holds (a request names one as its model)
    adapters: list[str] = field(default_factory=list)
    # num_running, num_waiting, kv_usage, num_free_blocks, ... (the engine's EngineStats)
    stats: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0  # time.time() of the last heartbeat

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["adapters"]:  # left out while unused: a peer that predates it reads the heartbeat
            del d["adapters"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineInfo:
        """From a heartbeat; ValueError when it is not one."""
        if not isinstance(d, dict):
            raise ValueError("an engine heartbeat must be a JSON object")
        info = cls(**d)
        ok = (
            isinstance(info.engine_id, str)
            and isinstance(info.model, str)
            and isinstance(info.max_model_len, int)
            and info.max_model_len > 0
            and isinstance(info.aliases, list)
            and all(isinstance(a, str) for a in info.aliases)
            and isinstance(info.adapters, list)
            and all(isinstance(a, str) for a in info.adapters)
            and isinstance(info.stats, dict)
            and isinstance(info.last_seen, (int, float))
        )
        if not ok:
            raise ValueError(f"not an engine heartbeat: {d!r:.200}")
        return info


@dataclass(slots=True)
class AdapterCommand:
    """An operator's change to the LoRA adapters of a model's engines (`POST
    /v1/load_lora_adapter`, `/v1/unload_lora_adapter`), sent to every engine of the model."""

    __pydantic_config__ = STRICT_DECODING

    command_id: str
    action: str  # "load" | "unload"
    name: str
    path: str = ""  # load: the adapter's directory on the engine's host

    def __post_init__(self) -> None:
        check(self.action in ("load", "unload"), "action", "load or unload", self.action)
        for name in ("command_id", "name"):
            v = getattr(self, name)
            ok = isinstance(v, str) and 1 <= len(v) <= MAX_ID_CHARS
            check(ok, name, f"a string of 1 to {MAX_ID_CHARS} characters", v)


@dataclass(slots=True)
class AdapterReply:
    """One engine's answer to an AdapterCommand: done, or why not (`status`: the HTTP status
    it means: 400 an adapter refused, 404 an unknown one to unload)."""

    __pydantic_config__ = STRICT_DECODING

    command_id: str
    engine_id: str
    status: int = 200
    error: str = ""
