"""The bodies of vLLM's `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`) and
`/v1/unload_lora_adapter` (`lora_name`), with wsllm's optional `model` on a load (the base
to load it on; the default model when absent), every 400 of their shape, and their charge:
admitted as every call (an rpm and a lease, no tokens)."""

from __future__ import annotations

from pydantic import Field

from wsllm.bounds import MAX_ID_CHARS
from wsllm.config_gateway import GatewayConfig
from wsllm.server.fields import Strict
from wsllm.server.quota import Charge, prompt_charge
from wsllm.server.schemas import body_object, validated

#: an adapter's name: what a request puts in `model` (no braces: it names a Redis key)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"


class LoadAdapter(Strict):
    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = Field(None, max_length=MAX_ID_CHARS)


class UnloadAdapter(Strict):
    lora_name: str = Field(pattern=NAME_PATTERN)
    lora_int_id: int | None = None  # vLLM's body may carry it; names are what count here


def validate_load(raw: bytes, cfg: GatewayConfig) -> LoadAdapter:
    return validated(LoadAdapter, body_object(raw, cfg))


def validate_unload(raw: bytes, cfg: GatewayConfig) -> UnloadAdapter:
    return validated(UnloadAdapter, body_object(raw, cfg))


def charge(req: LoadAdapter | UnloadAdapter, cfg: GatewayConfig) -> Charge:
    """A load goes to its base model; an unload to the adapter itself (resolved to its base:
    a 404 in OpenAI's shape when no engine holds it)."""
    model = req.model if isinstance(req, LoadAdapter) else req.lora_name
    return Charge(model, [prompt_charge(0, exact=True)])
