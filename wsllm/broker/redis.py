"""The Redis Streams broker: engines on any machine pull requests from a per-model
queue, results come back through each gateway's results stream (and each request's
history stream), and any gateway can pick a request up again (resume) within the
retention time.

Its two sides are two classes, one per contract of base.py: a gateway process makes a
`redis_gateway.RedisGateway` (asyncio), an engine process a `redis_engine.RedisEngine`
(blocking, the worker's thread). `RedisBroker` is both in one object, as the memory
broker is: for a process that plays both (tests, benches, tools). The key layout is in
`redis_keys.py`, the scripts in `lua/` (`redis_scripts.py`); recovery of a crashed
engine's requests is `redis_recovery.py` and `replay.py`; the reasons for the layout
are in docs/architecture.md.

    gateway = RedisGateway("redis://localhost:6379/0", model="SmolLM2-135M-Instruct")
    engine = RedisEngine("redis+cluster://10.0.0.1:7000,10.0.0.2:7000", model=..., engine_id="e1")
"""

from __future__ import annotations

from wsllm.broker.base import Broker
from wsllm.broker.redis_engine import RedisEngine
from wsllm.broker.redis_gateway import RedisGateway
from wsllm.config_redis import RedisConfig
from wsllm.types import EngineInfo


class RedisBroker(RedisGateway, RedisEngine, Broker):
    """A gateway side and an engine side of the same deployment in one object. What the
    two share is only their settings; its own part is the tie between them: the gateway
    sees an engine of this object at once (its registry copy is dropped when one
    registers), and `close` closes both."""

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
        cfg = cfg or RedisConfig()
        RedisGateway.__init__(
            self, url, model=model, cfg=cfg, max_queue_depth=max_queue_depth, max_queue_share=max_queue_share
        )
        RedisEngine.__init__(self, url, model=model, cfg=cfg, engine_id=engine_id)
        self._registered: set[str] = set()  # engine ids whose heartbeat this object sent

    def heartbeat(self, info: EngineInfo) -> None:
        RedisEngine.heartbeat(self, info)
        if info.engine_id not in self._registered:  # a new engine: this object's gateway sees it now
            self._registered.add(info.engine_id)
            self.invalidate_engines()

    def deregister(self, engine_id: str) -> None:
        self._registered.discard(engine_id)
        RedisEngine.deregister(self, engine_id)
        self.invalidate_engines()

    def close(self) -> None:
        RedisGateway.close(self)
        RedisEngine.close(self)
