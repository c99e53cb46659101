"""The Redis Streams broker: engines on any machine pull requests from a per-model
stream, results come back through one stream per request, and any gateway can pick
a request up again (resume) within the retention time.

One object per process side, like the memory broker; it implements both contracts
of base.py: a gateway uses the asyncio half (`redis_gateway.GatewaySide`, the
`GatewayBroker` methods), an engine worker the blocking half (`redis_engine.EngineSide`,
the `EngineBroker` methods). The key layout is in `redis_keys.py`; recovery of a
crashed engine's requests is in `redis_recovery.py` and `replay.py`; the reasons for
the layout are in docs/architecture.md.

    broker = RedisBroker("redis://localhost:6379/0", model="SmolLM2-135M-Instruct")
    broker = RedisBroker("redis+cluster://10.0.0.1:7000,10.0.0.2:7000", model=...)  # a cluster
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from wsllm.broker import prefix_routing
from wsllm.broker.base import Broker, Rank, Resumable
from wsllm.broker.limits import Limiter
from wsllm.broker.redis_conn import is_cluster, sync_client
from wsllm.broker.redis_engine import EngineSide
from wsllm.broker.redis_gateway import GatewaySide
from wsllm.broker.redis_keys import UNAVAILABLE, Keys
from wsllm.broker.redis_limits import RedisLimiter
from wsllm.broker.redis_responses import RedisResponseStore
from wsllm.broker.response_store import ResponseStore
from wsllm.config_redis import RedisConfig
from wsllm.types import EngineInfo, GenerateRequest, TokenEvent

log = logging.getLogger(__name__)


class RedisBroker(Broker):
    resumable = True

    def __init__(
        self,
        url: str,
        *,
        model: str,
        cfg: RedisConfig | None = None,
        max_queue_depth: int = 256,
        engine_id: str | None = None,
        max_queue_share: float = 1.0,
    ) -> None:
        self.cfg = cfg or RedisConfig()
        self.url = url
        self.model = model
        self.keys = Keys(self.cfg.redis_prefix)
        self.engine_ttl_s = self.cfg.engine_ttl_s
        self.queue_poll_s = self.cfg.queue_poll_s
        self.resume_grace_s = self.cfg.resume_grace_s
        # Blocking reads wait at most 0.25 s at a time (redis_engine._BLOCK_SLICE_S).
        self._sync: Any = sync_client(url, self.cfg, wait_s=0.25)
        self.cluster = is_cluster(url)
        consumer = engine_id or self.cfg.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.gateway = GatewaySide(url, self.keys, self.cfg, model, max_queue_depth, max_queue_share)
        self.engine = EngineSide(self._sync, self.keys, self.cfg, model, consumer)
        self._versions_ttl_at = 0.0  # when the prefix versions hash needs its TTL again
        self._prefix_sent: tuple[int, int, float] = (0, 0, 0.0)  # (block size, keys hash, when)
        self._registered: set[str] = set()  # engine ids whose heartbeat this broker sent

    @property
    def consumer(self) -> str:
        return self.engine.consumer

    # -- gateway side ------------------------------------------------------------------

    async def submit(
        self,
        request: GenerateRequest,
        *,
        context: dict[str, Any] | None = None,
    ) -> None:
        await self.gateway.submit(request, context)

    async def abort(self, request_id: str) -> None:
        await self.gateway.abort(request_id)

    async def abort_lost(self, request_id: str) -> None:
        await self.gateway.abort(request_id, keep=False)

    async def reachable(self, timeout: float) -> bool:
        return await self.gateway.ping(timeout)

    async def abort_unless_resumed(self, request_id: str, attach: int) -> bool:
        return await self.gateway.abort(request_id, attach=attach)

    def events(self) -> AsyncIterator[list[TokenEvent]]:
        return self.gateway.events()

    def forget(self, request_id: str) -> None:
        self.gateway.forget(request_id)

    async def lookup(self, request_id: str) -> Resumable | None:
        return await self.gateway.lookup(request_id)

    async def follow(self, request_id: str) -> int:
        return await self.gateway.follow(request_id)

    async def engines(self) -> list[EngineInfo]:
        return self._alive(await self.gateway.engines())

    async def pending(self) -> int:
        return await self.gateway.pending()

    async def position(self, request_id: str) -> int | None:
        return await self.gateway.position(request_id)

    async def tokenizer_files(self, model: str) -> dict[str, bytes] | None:
        return await self.gateway.tokenizer_files(model)

    def limiter(self) -> Limiter:
        return RedisLimiter(self.gateway.client, self.keys, self.cfg.limit_lease_s)

    def response_store(self) -> ResponseStore:
        return RedisResponseStore(self.gateway.client, self.keys)

    # -- engine side -------------------------------------------------------------------

    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        return self.engine.pull(max_n, timeout)  # a stream is read in order: rank is not used

    def aborts(self) -> list[str]:
        return self.engine.aborts()

    def publish(self, events: list[TokenEvent]) -> None:
        if events and not self.engine.closed.is_set():
            self.engine.publish(events)

    def heartbeat(self, info: EngineInfo) -> None:
        self.engine.heartbeat(info)
        if info.engine_id not in self._registered:  # a new engine: this process's gateway sees it now
            self._registered.add(info.engine_id)
            self.gateway.invalidate_engines()

    def publish_prefix(self, block_size: int, keys: list[bytes]) -> None:
        """Which prefix blocks this engine caches, for prefix-aware routing (the worker
        calls it when the broker has it)."""
        if self.cfg.routing == "prefix" and not self.engine.closed.is_set():
            ttl_ms = int(self.cfg.engine_ttl_s * 1000)
            now = time.monotonic()
            sent = (block_size, hash(tuple(keys)), now)
            if sent[:2] == self._prefix_sent[:2] and now - self._prefix_sent[2] < self.cfg.engine_ttl_s / 4:
                return  # the same summary, and its TTL is far off: nothing to tell
            try:
                refresh = now >= self._versions_ttl_at
                prefix_routing.publish(
                    self._sync, self.engine.queue, self.consumer, block_size, keys, ttl_ms, refresh
                )
                self._prefix_sent = sent
                if refresh:
                    self._versions_ttl_at = now + self.cfg.engine_ttl_s / 4
            except UNAVAILABLE as e:
                log.debug("redis unavailable for the prefix summary (%s)", e)

    def publish_tokenizer(self, model: str, files: dict[str, bytes]) -> None:
        if model != self.model:
            raise ValueError(f"this engine side serves {self.model!r}, not {model!r}")
        self.engine.publish_tokenizer(files)

    def deregister(self, engine_id: str) -> None:
        self._registered.discard(engine_id)
        self.engine.deregister(engine_id)
        self.gateway.invalidate_engines()

    def release(self, request_ids: list[str]) -> list[str]:
        return self.engine.release(request_ids)

    def dead_letter(self, item: object, reason: str) -> None:
        self.engine.dead.item(item, reason)

    def engine_alive(self, engine_id: str) -> bool:
        """Whether `engine_id`'s heartbeat is in Redis now (blocking; for tools)."""
        return bool(self._sync.exists(self.keys.engine(engine_id)))

    # -- both ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.gateway.closed:
            return
        self.gateway.closed = True
        self.engine.closed.set()
        try:  # wake the readers so that events() ends now, not at their next timeout
            for key in self.gateway.wake_keys():
                self._sync.xadd(key, {"x": "1"}, maxlen=1, approximate=False)
                self._sync.expire(key, 60)
        except UNAVAILABLE:
            pass
        self._sync.close()
