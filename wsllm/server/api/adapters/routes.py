"""vLLM's operator routes for LoRA adapters at run time: `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (docs/lora.md). Admitted like every call, then refused with 403
unless the key is the operator's (the `metrics` role: `--api-key`, or the keyless gateway's
anonymous tenant). The command goes to every live engine of the base model through the
broker (`GatewayBroker.command`); each applies it between two steps and answers. A load
succeeds when at least one engine holds the adapter after it; an unload when every engine
that answered let it go. A request that runs under an unloaded adapter finishes on it."""

from __future__ import annotations

import uuid

from starlette.routing import Route

from wsllm.server.admission import Admission
from wsllm.server.api.adapters.request import (
    LoadAdapter,
    UnloadAdapter,
    charge,
    validate_load,
    validate_unload,
)
from wsllm.server.errors import APIError
from wsllm.server.gateway import Gateway
from wsllm.server.http import Answer, Endpoint, route
from wsllm.server.resume import Api
from wsllm.server.wing import Wing
from wsllm.types import AdapterCommand, AdapterReply

#: how long the engines have to answer (a load reads and checks the adapter between two steps)
COMMAND_TIMEOUT_S = 60.0


def _operator(adm: Admission) -> None:
    if not adm.tenant.operator:
        raise APIError(403, "permission_denied", "loading and unloading adapters needs the operator's key")


def _outcome(replies: list[AdapterReply], what: str) -> tuple[int, AdapterReply | None]:
    """(how many engines did it, the first refusal); 503 when none answered."""
    if not replies:
        raise APIError(503, "model_not_ready", f"no engine answered the {what} in time", retry_after=1)
    done = [r for r in replies if r.status == 200]
    refused = next((r for r in replies if r.status != 200), None)
    return len(done), refused


def mount(gw: Gateway) -> Wing:
    async def command(adm: Admission, action: str, name: str, path: str = "") -> list[AdapterReply]:
        engines = len(await gw.models.engines(adm.model.name))
        if not engines:
            raise APIError(
                503, "model_not_ready", f"no engine is serving {adm.model.name!r} now", retry_after=1
            )
        cmd = AdapterCommand(f"cmd-{uuid.uuid4().hex}", action, name, path)
        return await gw.broker.command(adm.model.name, cmd, engines, COMMAND_TIMEOUT_S)

    async def load(adm: Admission, req: LoadAdapter) -> Answer:
        _operator(adm)
        if adm.model.lora:
            raise APIError(
                400, "invalid_request", "model: names an adapter; name the base model", param="model"
            )
        replies = await command(adm, "load", req.lora_name, req.lora_path)
        done, refused = _outcome(replies, "load")
        if not done and refused is not None:  # 404: no adapter at the path (vLLM's), 400: one refused
            code = "not_found" if refused.status == 404 else "invalid_request"
            raise APIError(refused.status, code, refused.error, param="lora_path")
        body = {
            "object": "lora_adapter", "id": req.lora_name, "parent": adm.model.name, "engines": done,
            "message": f"Success: LoRA adapter '{req.lora_name}' added successfully.",
        }  # fmt: skip
        if refused is not None:  # some engines could not (a path another host lacks): say so
            body["refused"] = refused.error
        return Answer.ready(body, await adm.settle(0, 0))

    async def unload(adm: Admission, req: UnloadAdapter) -> Answer:
        _operator(adm)
        if not adm.model.lora:  # the name resolved to a model itself, not an adapter
            raise APIError(
                404, "model_not_found", f"{req.lora_name!r} is not a LoRA adapter", param="lora_name"
            )
        replies = await command(adm, "unload", req.lora_name)
        done, refused = _outcome(replies, "unload")
        if refused is not None and refused.status != 404:
            raise APIError(refused.status, "invalid_request", refused.error, param="lora_name")
        body = {
            "object": "lora_adapter", "id": req.lora_name, "parent": adm.model.name, "engines": done,
            "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
        }  # fmt: skip
        return Answer.ready(body, await adm.settle(0, 0))

    return Wing(
        [
            Route(
                "/v1/load_lora_adapter",
                route(Endpoint(Api.ADAPTERS, validate_load, charge, load)),
                methods=["POST"],
            ),
            Route(
                "/v1/unload_lora_adapter",
                route(Endpoint(Api.ADAPTERS, validate_unload, charge, unload)),
                methods=["POST"],
            ),
        ]
    )
