"""One response on its way, from an admitted request (`Responses.start`): its stored
conversation loaded (`previous_response_id`), the request translated and prepared, its
engine request submitted; then its events (`ResponseRun`), and its end stored.

A response with `store` (the default) is kept by the broker's response store for
--response-ttl-s, readable only with a key of the tenant that made it (another key gets
404, as for an unknown id), within that tenant's budget (--response-tenant-max-bytes and
-records: its own oldest go first): the response itself, and its conversation (input and
output, in the kept shape) for a next turn's `previous_response_id`. It is stored
before its last event is sent, so a client can continue the moment it has read
`response.completed`. A `background` response runs on the gateway that took it
(`Responses.background`), stored `in_progress` at once and again when it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from wsllm.broker.base import BrokerError
from wsllm.broker.response_store import Budget, ResponseStore
from wsllm.config_gateway import GatewayConfig
from wsllm.server.admission import Admission
from wsllm.server.api.responses.render import Event, ResponseBuilder, output_turns, settings
from wsllm.server.api.responses.request import ResponsesRequest
from wsllm.server.api.responses.translate import Turn, renamed, stored_turns, to_chat, turns
from wsllm.server.errors import APIError
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.metrics import Metrics
from wsllm.server.quota import Charge, Coarse, text_tokens

log = logging.getLogger(__name__)

_ITEM_OVERHEAD_TOKENS = 4  # an item's role and template markers


def not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        "response_not_found" if param == "response_id" else "previous_response_not_found",
        f"{param}: no response {response_id!r} (unknown, expired, not stored, or another key's)",
        param,
    )


def charge(req: ResponsesRequest, cfg: GatewayConfig) -> Charge:
    """Its coarse charge, from the request alone (a stored conversation it continues is
    counted once it is tokenized): its instructions, input and tools, and its output."""
    texts = [req.instructions or ""] + ([req.input] if isinstance(req.input, str) else [])
    for item in [] if isinstance(req.input, str) else req.input:
        texts.append(item.model_dump_json(exclude_none=True))
    texts += [t.model_dump_json() for t in req.tools or []]
    prompt = sum(text_tokens(t) + _ITEM_OVERHEAD_TOKENS for t in texts)
    out = req.max_output_tokens
    return Charge(req.model, [Coarse(prompt + (out or cfg.default_max_tokens), out or 1)], req.priority)


def budget(cfg: GatewayConfig) -> Budget:
    """What one tenant may keep in the response store at once."""
    return Budget(cfg.response_tenant_max_bytes, cfg.response_tenant_max_records)


class Keeper:
    """Stores a finished response with its conversation, when the request asked, within
    its tenant's budget; a response deleted meanwhile stays deleted."""

    def __init__(
        self, store: ResponseStore, tenant: str, conversation: list[Turn], keep: bool, cfg: GatewayConfig
    ):
        self.store, self.tenant, self.conversation, self.keep_it = store, tenant, conversation, keep
        self.ttl_s, self.budget = cfg.response_ttl_s, budget(cfg)

    async def keep(self, b: ResponseBuilder) -> None:
        if not self.keep_it:
            return
        record = {
            "response": b.response,
            "conversation": self.conversation + output_turns(b.output),
            "inputs": len(self.conversation),  # the turns before this response's output
        }
        try:
            if not await self.store.put(b.id, self.tenant, orjson.dumps(record), self.ttl_s, self.budget):
                log.info("response %s not stored: deleted, or larger than its tenant's budget", b.id)
        except BrokerError:  # the answer is still the client's; only a next turn will miss it
            log.exception("response %s could not be stored", b.id)


class ResponseRun:
    """One response on its way: its engine request, its event machine, its keeper."""

    def __init__(self, gen: Generation, builder: ResponseBuilder, keeper: Keeper, metrics: Metrics) -> None:
        self.gen, self.builder, self.keeper, self.metrics = gen, builder, keeper, metrics

    async def batches(self, heartbeat_s: float | None) -> AsyncIterator[list[Event]]:
        """The response's events in batches as its answer comes ([] when `heartbeat_s`
        passed with nothing new). The last batch holds the closing events, sent once
        the response is stored; a failure mid-way ends it with `response.failed`."""
        b, held = self.builder, []
        try:
            async for batch in self.steps(heartbeat_s):
                if b.response["status"] == "in_progress":
                    yield batch
                else:
                    held = batch
        except GenerationError as e:
            self.metrics.error(e.code)
            held = b.fail(e.code, e.message)
        await self.keeper.keep(b)
        yield held

    async def steps(self, heartbeat_s: float | None) -> AsyncIterator[list[Event]]:
        """The events of each step of the answer, the closing ones last. Raises
        GenerationError."""
        gen, b = self.gen, self.builder
        yield b.start()
        reason = None
        while not gen.finished:
            events: list[Event] = []
            for d in await gen.next(timeout=heartbeat_s):
                if d.index == 0:  # a response has one choice
                    events += b.feed(d)
                    reason = d.finish_reason or reason
            yield events
        yield b.finish(reason, gen.usage)

    async def whole(self) -> dict[str, Any]:
        """The whole response (stored when asked). Raises GenerationError."""
        async for _ in self.steps(None):
            pass
        await self.keeper.keep(self.builder)
        return self.builder.response

    async def in_background(self) -> None:
        """Run to its end here (a background response): its end is stored, failed or not."""
        try:
            await self.whole()
        except GenerationError as e:
            self.metrics.error(e.code)
            self.builder.fail(e.code, e.message)
            await self.keeper.keep(self.builder)
        finally:
            await self.gen.cancel()  # no-op when it finished; releases the tenant's limits


class Responses:
    """The wing's state on one gateway: the response store (the broker's) and the
    background responses running here, by id."""

    def __init__(self, store: ResponseStore, cfg: GatewayConfig, metrics: Metrics) -> None:
        self.store, self.cfg, self.metrics = store, cfg, metrics
        self.background: dict[str, tuple[Generation, asyncio.Task[None]]] = {}

    async def start(self, adm: Admission, req: ResponsesRequest) -> ResponseRun:
        """Load what it continues, translate, prepare and submit an admitted request."""
        history = await self.history(req.previous_response_id, adm.tenant.name)
        conversation = history + turns(req)
        try:
            chat = to_chat(req, conversation, len(history), self.cfg)
            gen = await adm.start(0, chat)
        except APIError as e:
            raise renamed(e) from None
        response_id = "resp_" + gen.request_id.partition("-")[2]
        keeper = Keeper(self.store, adm.tenant.name, conversation, req.store, self.cfg)
        builder = ResponseBuilder(response_id, settings(req, gen.context.served_as), gen.context.created)
        return ResponseRun(gen, builder, keeper, self.metrics)

    async def history(self, previous: str | None, tenant: str) -> list[Turn]:
        """The conversation a `previous_response_id` continues; 404 when the key cannot see it."""
        if previous is None:
            return []
        raw = await self.store.get(previous, tenant)
        if raw is None:
            raise not_found(previous, "previous_response_id")
        return stored_turns(orjson.loads(raw)["conversation"])

    async def stored(self, response_id: str, tenant: str) -> dict[str, Any]:
        """The stored record of `response_id`, for this tenant; else 404."""
        raw = await self.store.get(response_id, tenant)
        if raw is None:
            raise not_found(response_id, "response_id")
        record: dict[str, Any] = orjson.loads(raw)
        return record
