"""The gateway side of the Redis broker (`RedisGateway`, the `GatewayBroker` contract):
redis.asyncio on the app's event loop. The registry of engines it reads through
`redis_registry.RegistryReader`.

The reader (`events()`) runs one `redis_reader.ModelReader` per model: the gateway's
own results stream of the model carries every step's events of all its requests; a
resumed request is read from its history stream and the results stream it went
through. Every event's `seq` is checked per choice, so a duplicate (a retried
publish, or the history's copy) is dropped and a gap ends the request with
`worker_lost` instead of wrong text. An entry it cannot read ends its own request
with `worker_lost` and nothing else. When Redis comes back after an outage its readers check
that each followed request still exists (Redis may have restarted empty) and ends
those that do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis.exceptions

from wsllm.broker import redis_queue
from wsllm.broker.base import BrokerClosed, BrokerUnavailable, GatewayBroker, QueueFull, Resumable
from wsllm.broker.fair_queue import QUEUE_FULL, TENANT_SHARE_FULL, tenant_cap
from wsllm.broker.limits import Limiter
from wsllm.broker.prefix_routing import PrefixRouter
from wsllm.broker.redis_adapters import adapter_target, send_command
from wsllm.broker.redis_conn import async_client, eval_script, sync_client
from wsllm.broker.redis_follow import Follow, Read
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_limits import RedisLimiter
from wsllm.broker.redis_queue import Positions
from wsllm.broker.redis_reader import READ_BLOCK_MS, ModelReader, sid
from wsllm.broker.redis_registry import RegistryReader
from wsllm.broker.redis_responses import RedisResponseStore
from wsllm.broker.redis_retention import retire
from wsllm.broker.redis_scripts import ABORT, SUBMIT
from wsllm.broker.response_store import ResponseStore
from wsllm.config_redis import RedisConfig
from wsllm.prefix_hash import request_images, request_root
from wsllm.types import AdapterCommand, AdapterReply, EngineInfo, GenerateRequest, TokenEvent
from wsllm.wire import encode

log = logging.getLogger(__name__)

_MODEL_CACHE = 10000  # request id -> model, learned by lookups


class RedisGateway(GatewayBroker):
    """A gateway's side of the Redis broker. `model` is its default model (requests that
    name none); `max_queue_depth` and `max_queue_share` bound the waiting requests."""

    resumable = True

    def __init__(
        self,
        url: str,
        *,
        model: str,
        cfg: RedisConfig | None = None,
        max_queue_depth: int = 256,
        max_queue_share: float = 1.0,
    ) -> None:
        self.url = url
        self.cfg = cfg = cfg or RedisConfig()
        self.keys = Keys(cfg.redis_prefix)
        self.engine_ttl_s = cfg.engine_ttl_s
        self.queue_poll_s = cfg.queue_poll_s
        self.resume_grace_s = cfg.resume_grace_s
        self.model = model
        self.max_queue_depth = max_queue_depth
        self.tenant_cap = tenant_cap(max_queue_depth, max_queue_share)
        self.router = PrefixRouter() if cfg.routing == "prefix" else None
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.closing = False
        # One client per event loop: tests run several loops, and a client is bound to one.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self._results_ttl_ms = cfg.results_ttl_ms
        self._models: set[str] = {model}  # the models this gateway reads (one reader each)
        self._model_of: OrderedDict[str, str] = OrderedDict()
        self._out: asyncio.Queue[list[Read]] | None = None  # the readers' batches
        self._readers: dict[str, tuple[ModelReader, asyncio.Task[None]]] = {}
        self._follows: dict[str, Follow] = {}
        self.positions = Positions(cfg.queue_poll_s)  # of its requests waiting in a queue
        self.registry = RegistryReader(self.client, self.keys, cfg, self._unavailable)

    def client(self) -> Any:  # redis-py's reply types are too loose to be useful here
        loop = asyncio.get_running_loop()
        r = self._clients.get(loop)
        if r is None:
            r = self._clients[loop] = async_client(self.url, self.cfg)
        return r

    def _unavailable(self, e: BaseException) -> BrokerUnavailable:
        """The error for an unreachable Redis; the cached registry goes too (/ready must not
        report engines it cannot see now)."""
        self.invalidate_engines()
        return BrokerUnavailable(f"redis is unreachable: {e}")

    async def _call(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await eval_script(self.client(), script, keys, args)
        except UNAVAILABLE as e:
            raise self._unavailable(e) from None

    # -- submit and abort ----------------------------------------------------------------

    async def submit(
        self, request: GenerateRequest, *, context: dict[str, Any] | None = None, target: str = ""
    ) -> None:
        """Queue `request` (for engine `target` first, when routed: `redis_queue.py`)."""
        if self.closing:
            raise BrokerClosed("the broker is closed")
        rid = request.request_id
        model = request.model or self.model
        meta = orjson.dumps({"ctx": context or {}, "n": request.params.n, "model": model})
        keys = [self.keys.queue(model), self.keys.out(model, rid)]
        if request.lora:  # only the engines that hold the adapter take it (redis_adapters.py)
            target = adapter_target(request.lora)
        if not target and self.router is not None and self.registry.routable(model, self.model):
            try:
                target = await self.router.target(
                    self.client(),
                    keys[0],
                    request.prompt_token_ids,
                    request_root(request),
                    request_images(request),
                )
            except UNAVAILABLE as e:
                raise self._unavailable(e) from None
        results = self.keys.results(model, self.gateway_id)
        reader = self._readers.get(model)
        # Before it can have events; from where this model's reader is now (see redis_reader).
        self._follows[rid] = Follow(
            model, n=request.params.n, results=results, tail_id=reader[0].cursor if reader else "0-0"
        )
        self._start_reader(model)
        ttl_ms = int(self.cfg.request_ttl_s * 1000)
        try:
            args = redis_queue.submit_args(
                self.max_queue_depth, self.tenant_cap, encode(request), meta, ttl_ms, rid,
                request.queue_deadline, request.priority, request.tenant, target, results,
            )  # fmt: skip
            ok, value, where = await self._call(SUBMIT, keys, args)
        except BaseException:
            self._follows.pop(rid, None)
            raise
        if not ok:
            self._follows.pop(rid, None)
            raise QueueFull(TENANT_SHARE_FULL if where == b"tenant" else QUEUE_FULL)
        self.positions.waits(rid, model, value.decode(), where.decode())

    async def abort(self, request_id: str) -> None:
        await self._abort(request_id)

    async def abort_lost(self, request_id: str) -> None:
        await self._abort(request_id, keep=False)

    async def abort_unless_resumed(self, request_id: str, attach: int) -> bool:
        return await self._abort(request_id, attach=attach)

    async def _abort(self, request_id: str, attach: int | None = None, keep: bool = True) -> bool:
        """Abort; with `attach`, only if no client resumed the request since then. With
        `keep` False its result stream goes at once (its resume token then names nothing)
        instead of staying resumable for the retention time."""
        model = await self.model_of(request_id)
        self.forget(request_id)
        if model is None:
            return False  # no result stream: nothing to end (the script would say -1)
        marker = encode([TokenEvent.abort_marker(request_id)])
        keys = [
            self.keys.out(model, request_id),
            self.keys.attached(model, request_id),
            self.keys.aborts(model),
        ]
        retention = int(self.cfg.stream_retention_s * 1000) if keep else 0  # PEXPIRE 0 deletes
        attached = "" if attach is None else str(attach)
        args = [request_id, retention, marker, attached, self._results_ttl_ms, self.cfg.aborts_maxlen]
        return bool(await self._call(ABORT, keys, args) == 1)

    async def retire(self, request_id: str, model: str, tenant: str) -> None:
        try:
            await retire(self.client(), self.keys, model, request_id, tenant)
        except UNAVAILABLE as e:  # its keys expire after the retention instead
            log.warning("could not drop the keys of %s at once: %s", request_id, e)

    async def model_of(self, request_id: str) -> str | None:
        """The model whose slot holds the request's result stream: known for a request
        this gateway follows or looked up, else found among the models it knows of
        (its own, those it served, those of live engines). None: no such stream."""
        f = self._follows.get(request_id)
        if f is not None:
            return f.model
        if request_id in self._model_of:
            return self._model_of[request_id]
        models = [self.model, *sorted(self._models - {self.model})]
        with contextlib.suppress(BrokerUnavailable):
            models += sorted({i.model for i in await self.engines()} - set(models))
        try:
            pipe = self.client().pipeline(transaction=False)
            for m in models:
                pipe.exists(self.keys.out(m, request_id))
            found = await pipe.execute()
        except UNAVAILABLE as e:
            raise self._unavailable(e) from None
        for m, n in zip(models, found, strict=True):
            if n:
                self._model_of[request_id] = m
                while len(self._model_of) > _MODEL_CACHE:
                    self._model_of.popitem(last=False)
                return m
        return None

    async def reachable(self, timeout: float) -> bool:
        """Whether Redis answers a PING within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                return bool(await self.client().ping())
        except (TimeoutError, *UNAVAILABLE):
            return False

    # -- resume --------------------------------------------------------------------------

    async def lookup(self, request_id: str) -> Resumable | None:
        model = await self.model_of(request_id)
        if model is None:
            return None
        try:
            first = await self.client().xrange(self.keys.out(model, request_id), count=1)
        except UNAVAILABLE as e:
            raise self._unavailable(e) from None
        if not first or b"m" not in first[0][1]:
            return None
        try:
            ctx = orjson.loads(first[0][1][b"m"]).get("ctx")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return Resumable(request_id, ctx) if isinstance(ctx, dict) else None

    async def follow(self, request_id: str) -> int:
        """Read the request's stream from its start; count the attach (the grace abort
        of the client that left before is off). Returns the new attach count."""
        model = await self.model_of(request_id) or self.model
        # At once (no await before it): a read for the follow this one replaces must not
        # hand this client events after it asked to start over. Its history stream first;
        # the results stream it goes on in once its meta is read.
        old = self._follows.get(request_id)
        if old is not None:  # its events not yet handed on were the old client's
            old.stale = True
        f = self._follows[request_id] = Follow(model, history=True)
        self._start_reader(model)
        try:
            first = await self.client().xrange(self.keys.out(model, request_id), count=1)
        except UNAVAILABLE as e:
            self._follows.pop(request_id, None)
            raise self._unavailable(e) from None
        meta = first[0][1] if first else {}
        results = meta.get(b"s", b"").decode(errors="replace")
        if results.startswith(self.keys.model_tag(model) + ":"):  # else only its history stream
            submitted = first[0][0].decode(errors="replace")  # the meta entry's id: its submit time
            f.results, f.tail_id = results, f"{max(0, sid(submitted)[0] - 1)}-0"  # events after it
        pipe = self.client().pipeline(transaction=False)
        pipe.incr(self.keys.attached(model, request_id))
        pipe.pexpire(self.keys.attached(model, request_id), int(self.cfg.request_ttl_s * 1000))
        pipe.xadd(self.keys.wake(model, self.gateway_id), {"x": "1"}, maxlen=1, approximate=False)
        try:
            attach, _, _ = await pipe.execute()
        except UNAVAILABLE as e:
            self._follows.pop(request_id, None)
            raise self._unavailable(e) from None
        return int(attach)

    @property
    def follows(self) -> dict[str, Follow]:
        return self._follows

    def follows_of(self, model: str) -> list[tuple[str, Follow]]:
        return [(r, f) for r, f in self._follows.items() if f.model == model]

    def started(self, request_id: str) -> None:
        """The request has events: it no longer waits in the queue."""
        self.positions.left(request_id)

    def forget(self, request_id: str) -> None:
        """Stop following the request (its client left, or it was aborted): events read
        for it and not yet handed on are dropped."""
        f = self.ended(request_id)
        if f is not None:
            f.stale = True

    def ended(self, request_id: str) -> Follow | None:
        """The reader handed on the request's last event: stop following it."""
        f = self._follows.pop(request_id, None)
        self.positions.left(request_id)
        self._model_of.pop(request_id, None)
        return f

    # -- the reader ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[list[TokenEvent]]:
        """The events of every followed request, from one reader task per model."""
        self._out = out = asyncio.Queue[list[Read]]()
        for m in list(self._models):
            self._start_reader(m)
        try:
            while not self.closing:
                with contextlib.suppress(TimeoutError):
                    reads = await asyncio.wait_for(out.get(), READ_BLOCK_MS / 1000)
                    # Checked now, as the batch is routed: a resume may have replaced a
                    # follow while its events waited in the queue (redis_follow.Read).
                    batch = [ev for ev, f in reads if f is None or not f.stale]
                    if len(batch) < len(reads):
                        log.info(
                            "dropped %d events read for a client that resumed since", len(reads) - len(batch)
                        )
                    if batch:
                        yield batch
        finally:
            self._out = None
            readers, self._readers = [t for _, t in self._readers.values()], {}
            for t in readers:
                t.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    def _start_reader(self, model: str) -> None:
        """A reader for `model`'s streams, once events() runs (it starts those it lacks)."""
        self._models.add(model)
        if self._out is not None and model not in self._readers:
            reader = ModelReader(self, model)
            task = asyncio.get_running_loop().create_task(reader.run(self._out), name=f"wsllm-read-{model}")
            self._readers[model] = (reader, task)

    # -- registry and queue ----------------------------------------------------------------

    async def tokenizer_files(self, model: str) -> dict[str, bytes] | None:
        return await self.registry.tokenizer_files(model)

    async def engines(self) -> list[EngineInfo]:
        return self._alive(await self.registry.engines())

    async def command(
        self, model: str, command: AdapterCommand, engines: int, timeout: float
    ) -> list[AdapterReply]:
        try:
            return await send_command(self.client(), self.keys, model, command, engines, timeout, self.cfg)
        finally:  # their heartbeats, sent before they answered, hold the change (or Redis is gone)
            self.invalidate_engines()

    def invalidate_engines(self) -> None:
        self.registry.invalidate()

    async def pending(self) -> int:
        """Waiting requests of the model: its queue's counters (hand-backs included)."""
        try:
            n, h = await self.client().hmget(redis_queue.counters_key(self.keys.queue(self.model)), "n", "h")
        except (*UNAVAILABLE, redis.exceptions.ResponseError):
            return 0
        return max(0, int(n or 0) + int(h or 0))

    async def position(self, request_id: str) -> int | None:
        if request_id not in self.positions:
            return 0 if request_id in self._follows else None
        try:
            return await self.positions.place(self.client(), self.keys.queue, request_id)
        except UNAVAILABLE:
            return None

    def limiter(self) -> Limiter:
        return RedisLimiter(self.client, self.keys, self.cfg.limit_lease_s)

    def response_store(self) -> ResponseStore:
        return RedisResponseStore(self.client, self.keys)

    def close(self) -> None:
        """events() ends now: its readers are woken (not left to their next timeout)."""
        if self.closing:
            return
        self.closing = True
        try:
            r = sync_client(self.url, self.cfg)
            for key in [self.keys.wake(m, self.gateway_id) for m in sorted(self._models)]:
                r.xadd(key, {"x": "1"}, maxlen=1, approximate=False)
                r.expire(key, 60)
            r.close()
        except UNAVAILABLE:
            pass
