"""What a request asks to constrain its output with: OpenAI's `response_format`, vLLM's
`structured_outputs` and OpenAI's `logit_bias`, turned into SamplingParams' `structured`
and `logit_bias` while the request is validated (a bad one is a 400 naming its field).
Whether a schema, regex or grammar compiles is checked after admission (prepare.checked)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from wsllm.bounds import MAX_TOKEN_ID
from wsllm.server.fields import Strict, invalid, wire_check


class JsonSchemaFormat(Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of the four."""

    json_: dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF


def asked_structure(
    so: StructuredOutputs | None, rf: ResponseFormat | None
) -> tuple[dict[str, Any], str] | None:
    """The SamplingParams.structured spec a request asks for, with the field that asked
    (for a 400 naming it); None for free text."""
    if so is not None:
        pairs = (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
        given = {k: v for k, v in pairs if v is not None}
        if len(given) != 1:
            raise invalid("structured_outputs", "give exactly one of json, regex, choice, grammar")
        if rf is not None and rf.type != "text":
            raise invalid("structured_outputs", "give either structured_outputs or response_format, not both")
        return given, "structured_outputs"
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json": True}, "response_format"
    if rf.json_schema is None:
        raise invalid("response_format.json_schema", 'required with "type": "json_schema"')
    schema = rf.json_schema.schema_
    return {"json": True if schema is None else schema}, "response_format.json_schema.schema"


def token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (string keys) with token ids for keys; None when empty."""
    if not logit_bias:
        return None
    out: dict[int, float] = {}
    for key, value in logit_bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
            raise invalid("logit_bias", f"keys are token ids (0 to {MAX_TOKEN_ID}), got {key!r}")
        out[int(key)] = value
    wire_check("logit_bias", out)  # each bias in its range
    return out
