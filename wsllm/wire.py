"""The one codec for everything that crosses a process: `GenerateRequest` and batches of
`TokenEvent` (wsllm/types.py) as orjson with a schema version, decoded strictly.

An entry that is not exactly a wire message (a string where a number goes, a missing or
unknown field, a value out of its bounds) raises `WireError` naming the field, so that a
bad entry costs its own request and nothing else. Nothing is ever pickled."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from wsllm.types import (
    SCHEMA_VERSION,
    STRICT_DECODING,
    AdapterCommand,
    AdapterReply,
    GenerateRequest,
    TokenEvent,
    WireError,
)


@dataclass(slots=True)
class _RequestMsg:
    __pydantic_config__ = STRICT_DECODING
    v: Literal[1]
    kind: Literal["request"]
    item: GenerateRequest


@dataclass(slots=True)
class _EventsMsg:
    __pydantic_config__ = STRICT_DECODING
    v: Literal[1]
    kind: Literal["events"]
    items: list[TokenEvent]


_requests: TypeAdapter[_RequestMsg] = TypeAdapter(_RequestMsg)
_events: TypeAdapter[_EventsMsg] = TypeAdapter(_EventsMsg)
_request_object: TypeAdapter[GenerateRequest] = TypeAdapter(GenerateRequest)


def encode(obj: GenerateRequest | list[TokenEvent]) -> bytes:
    """One codec for everything that crosses a process."""
    if isinstance(obj, list):
        return orjson.dumps({"v": SCHEMA_VERSION, "kind": "events", "items": [_event_dict(e) for e in obj]})
    # logit_bias maps integer token ids: JSON writes its keys as strings ("50256"), which
    # decoding turns back into integers
    return orjson.dumps(
        {"v": SCHEMA_VERSION, "kind": "request", "item": _request_dict(obj)}, option=orjson.OPT_NON_STR_KEYS
    )


# Optional fields added within schema version 1 are left out of the encoding while unset,
# so that a peer that predates them reads every message that does not use them (and one
# that uses them fails loudly there, naming the field).


def _event_dict(e: TokenEvent) -> dict[str, Any]:
    # shallow: asdict() deep-copies a prompt-logprobs table (130-250 ms for 1,500 x 20 on
    # the engine's step thread, per publish); orjson writes the nested lists as they are
    d = {f.name: getattr(e, f.name) for f in fields(e)}
    for name in ("prompt_logprobs", "embedding"):
        if d[name] is None:
            del d[name]
    return d


def _request_dict(r: GenerateRequest) -> dict[str, Any]:
    d = asdict(r)
    for name in ("cache_salt", "lora", "images"):
        if not d[name]:
            del d[name]
    for name in ("prompt_logprobs", "structured", "logit_bias", "pooling"):
        if d["params"][name] is None:
            del d["params"][name]
    return d


def _wire_error(e: ValidationError, what: str) -> WireError:
    first = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or what
    msg = str(first["msg"]).removeprefix("Value error, ")
    return WireError(f"{where}: {msg}")


def decode_request(data: bytes | str) -> GenerateRequest:
    """A GenerateRequest from the wire; WireError when it is not exactly one."""
    try:
        return _requests.validate_json(data).item
    except ValidationError as e:
        raise _wire_error(e, "request") from None


def decode_events(data: bytes | str) -> list[TokenEvent]:
    """A batch of TokenEvents from the wire; WireError when it is not exactly one."""
    try:
        return _events.validate_json(data).items
    except ValidationError as e:
        raise _wire_error(e, "events") from None


def check_request(request: object) -> GenerateRequest:
    """The same strict checks for a request handed over in-process (memory broker)."""
    if not isinstance(request, GenerateRequest):
        raise WireError(f"not a GenerateRequest: {type(request).__name__}")
    try:
        return _request_object.validate_python(request)
    except ValidationError as e:
        raise _wire_error(e, "request") from None


_commands: TypeAdapter[AdapterCommand] = TypeAdapter(AdapterCommand)
_replies: TypeAdapter[AdapterReply] = TypeAdapter(AdapterReply)


def encode_adapter(obj: AdapterCommand | AdapterReply) -> bytes:
    """An adapter command or an engine's reply to one, for the broker."""
    return orjson.dumps(asdict(obj))


def decode_command(data: bytes | str) -> AdapterCommand:
    try:
        return _commands.validate_json(data)
    except ValidationError as e:
        raise _wire_error(e, "command") from None


def decode_reply(data: bytes | str) -> AdapterReply:
    try:
        return _replies.validate_json(data)
    except ValidationError as e:
        raise _wire_error(e, "reply") from None
