"""The gateway's own records of a request: the API it came in through and what a
gateway needs to rebuild its text work on a resume (stored with the request by a
resumable broker as a plain dict; the broker never reads it)."""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from wsllm.server.chat.output import OutputOptions
from wsllm.types import SamplingParams


def new_token(request_id: str) -> tuple[str, str]:
    """A new resume token for `request_id` (`{request id}.{secret}`, for its client alone)
    and the SHA-256 of its secret (what the broker stores)."""
    secret = secrets.token_urlsafe(24)
    return f"{request_id}.{secret}", _digest(secret)


def split_token(token: str) -> tuple[str, str]:
    """(request id, secret) of a resume token; ("", "") when it is not one."""
    rid, dot, secret = token.rpartition(".")
    return (rid, secret) if dot and rid and secret else ("", "")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Api(enum.StrEnum):
    """The API a request came in through: it names the request's metrics label and
    decides its id's prefix and whether its output is read as a chat answer."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    WS_CHAT = "ws_chat"
    WS_COMPLETION = "ws_completion"
    MESSAGES = "messages"  # Anthropic's /v1/messages: a chat answer in its own shapes
    RESPONSES = "responses"  # OpenAI's /v1/responses
    EMBEDDINGS = "embeddings"  # /v1/embeddings: one request per input, no text out
    TOKENIZE = "tokenize"  # /tokenize, /detokenize: admitted, nothing queued
    ADAPTERS = "adapters"  # /v1/load_lora_adapter, /v1/unload_lora_adapter: the operator's

    @property
    def is_chat(self) -> bool:
        return self in (Api.CHAT, Api.WS_CHAT, Api.MESSAGES, Api.RESPONSES)

    @property
    def id_prefix(self) -> str:
        """OpenAI's: `chatcmpl-` for a chat answer, `cmpl-` for a completion, `resp` for a
        Responses answer (its response id is `resp_` and the same hex); Anthropic's `msg`
        for a message."""
        if self is Api.MESSAGES:
            return "msg"
        if self is Api.RESPONSES:
            return "resp"
        if self is Api.EMBEDDINGS:
            return "embd"
        if self is Api.TOKENIZE:
            return "tok"
        if self is Api.ADAPTERS:
            return "lora"
        return "chatcmpl" if self.is_chat else "cmpl"


# Prompt tokens kept with a resumable request: the detokenizer's context on replay.
CONTEXT_TAIL = 8


@dataclass(slots=True)
class ResumeContext:
    """What a gateway needs to rebuild a request's text work that another gateway (or
    connection) started: stored with the request by a resumable broker, as the plain
    dict of `encode`. Its keys are those older gateways wrote, so either reads the
    other's; unknown keys are ignored."""

    api: Api
    model: str
    n: int = 1
    logprobs: int | None = None  # top logprobs per token; None: none asked
    stops: list[str] = field(default_factory=list)
    prompt_len: int = 0
    prompt_tail: list[int] = field(default_factory=list)  # the last CONTEXT_TAIL prompt tokens
    created: int = 0  # unix seconds, OpenAI's `created`
    #: how a chat answer is read; None: as text (stored as the options' own encoding)
    output: OutputOptions | None = None
    include_usage: bool = False  # SSE: a last chunk with the usage
    token_sha256: str = ""  # hash of the resume token's secret; set at submission
    lora: str = ""  # the LoRA adapter it runs under (`model` stays its base: routing, the watchdog)
    #: what else its SSE chunks carry, by the API's own names (vLLM's `token_ids`, ...)
    extras: list[str] = field(default_factory=list)
    #: the tenant whose key started it: only that tenant resumes it (set at submission)
    tenant: str = ""

    @property
    def served_as(self) -> str:
        """The name its answers carry: the adapter the client asked for, or the model."""
        return self.lora or self.model

    @classmethod
    def start(
        cls,
        api: Api,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        output: OutputOptions | None = None,
        include_usage: bool = False,
    ) -> ResumeContext:
        """The context of a request that starts now."""
        return cls(
            api,
            model,
            params.n,
            params.logprobs,
            list(stops),
            len(prompt_ids),
            list(prompt_ids[-CONTEXT_TAIL:]),
            int(time.time()),
            output,
            include_usage,
        )

    def matches(self, secret: str, tenant: str) -> bool:
        """Whether `secret` is the one its resume token was made with (constant time),
        shown by the tenant that started it (another key with the token is refused as a
        wrong token is: it learns nothing)."""
        ok = bool(self.token_sha256) and hmac.compare_digest(self.token_sha256, _digest(secret))
        return ok and hmac.compare_digest(self.tenant.encode(), tenant.encode())

    def encode(self) -> dict[str, Any]:
        """A plain dict of JSON values (what the broker stores); `lora`, `extras` and `tenant`
        only when set, so that a gateway that predates them reads the rest as ever."""
        d = asdict(self) | {"api": self.api.value, "output": self.output and self.output.to_context()}
        for key in ("lora", "extras", "tenant"):
            if not d[key]:
                del d[key]
        return d

    @classmethod
    def decode(cls, d: object) -> ResumeContext:
        """From `encode`'s dict; ValueError naming the field when it is not one."""
        if not isinstance(d, dict):
            raise ValueError(f"a resume context must be an object, got {type(d).__name__}")

        def get(key: str, default: Any, ok: Callable[[Any], bool]) -> Any:
            value = d.get(key, default)
            if not ok(value):
                raise ValueError(f"resume context: bad {key} {value!r:.80}")
            return value

        def whole(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        return cls(
            Api(get("api", None, lambda x: isinstance(x, str))),  # ValueError for an unknown API
            get("model", "", lambda x: isinstance(x, str)),
            get("n", 1, whole),
            get("logprobs", None, lambda x: x is None or whole(x)),
            get("stops", [], lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x)),
            get("prompt_len", 0, whole),
            get("prompt_tail", [], lambda x: isinstance(x, list) and all(whole(t) for t in x)),
            get("created", 0, whole),
            OutputOptions.from_context(get("output", None, lambda x: x is None or isinstance(x, dict))),
            get("include_usage", False, lambda x: isinstance(x, bool)),
            get("token_sha256", "", lambda x: isinstance(x, str)),
            get("lora", "", lambda x: isinstance(x, str)),
            get("extras", [], lambda x: isinstance(x, list) and all(isinstance(e, str) for e in x)),
            get("tenant", "", lambda x: isinstance(x, str)),
        )
