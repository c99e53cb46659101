"""What every request schema is built of: the strict base, fields accepted with no
effect, fields bounded by their one declaration in wsllm/types.py (SAMPLING_BOUNDS,
REQUEST_BOUNDS), and the 400 that names a field. The WebSocket hello's `bounds` is
the same declaration, as a request sees it (`bounds_table`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from wsllm.bounds import SAMPLING_BOUNDS, Bound
from wsllm.server.errors import APIError


class Strict(BaseModel):
    # An unknown field is a 400 naming it (errors.from_validation): nothing a client asks
    # for is dropped without a word. OpenAI fields that have no effect here are declared
    # as `Inert` on the models that take them (docs/protocol.md, "Fields with no effect").
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


# A field that is accepted and has no effect here (OpenAI's bookkeeping fields, and what
# clients send back in an assistant message they got); never used, never dumped.
Inert = Annotated[Any, Field(None, exclude=True)]


def invalid(param: str, message: str) -> APIError:
    """The 400 for a request the schema let through: `param` names the field."""
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


def announced(bound: Bound) -> dict[str, Any]:
    """The range a request may ask for: the wire's, or the API's tighter upper end; an
    off value is the lowest (on an integer, what lies between is off too: top_k's 0)."""
    out: dict[str, Any] = {
        "min": bound.lo if bound.off is None else bound.off,
        "max": bound.hi if bound.api_hi is None else bound.api_hi,
        "integer": bound.integer,
    }
    if bound.lo_open and bound.off is None:
        out["min_exclusive"] = True
    if bound.hi_open:
        out["max_exclusive"] = True
    if bound.items is not None:
        out["max_items"] = bound.items
    return out


def bounds_table() -> dict[str, dict[str, Any]]:
    """The WebSocket hello's `bounds`: what a request may ask for, per sampling parameter."""
    return {name: announced(b) for name, b in SAMPLING_BOUNDS.items()}


def ranged(name: str, table: dict[str, Bound] = SAMPLING_BOUNDS, default: Any = None) -> Any:
    """A request field bounded by `table[name]` (a list or map: at most its `items`
    entries; their values are for `wire_check`)."""
    b = table[name]
    if b.items is not None:
        return Field(default, max_length=b.items)
    r = announced(b)
    lo, hi = ("gt" if r.get("min_exclusive") else "ge"), ("lt" if r.get("max_exclusive") else "le")
    return Field(default, **{lo: r["min"], hi: r["max"]})


def wire_check(name: str, value: Any) -> None:
    """SamplingParams' own check of one field, run while the request is validated: the
    400 it would give later, with the same message."""
    try:
        SAMPLING_BOUNDS[name].check(name, value)
    except ValueError as e:
        raise APIError(400, "invalid_request", str(e)) from None
