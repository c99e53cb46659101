"""How long a finished request's events stay in Redis for a resume, on both sides:

- the engine side, as requests end in a step (`retain`, one script per tenant in the
  step's pipeline: lua/stream_retain.lua): each ended request's history stream is
  recorded in its tenant's kept set with its bytes; past the tenant's
  `--stream-retention-tenant-bytes` (per model) its own oldest streams go, never another
  tenant's; what stays expires after `--stream-retention-s`;
- the gateway side, once its client took the whole answer (`retire`: the done event
  handed to its transport; lua/stream_retire.lua): the request's keys go at once, since
  nobody will resume it.

The gateways' results streams, which carry every request's every event, keep only a
short tail (`RedisConfig.results_tail_s`): an ended request's last events are copied to
its own history stream when it ends (redis_publish.py), so a resume after it ended
reads its history alone. `redis_memory` is the arithmetic of Redis's memory (docs/
deployment.md gives it with figures)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from wsllm.broker.redis_conn import eval_script
from wsllm.broker.redis_keys import Keys
from wsllm.broker.redis_scripts import STREAM_RETAIN, STREAM_RETIRE
from wsllm.config_redis import RedisConfig

#: what a history stream holds beyond its events' bytes: its key, its meta entry and Redis's own
#: (a stream's first node takes 4 KB; MEMORY USAGE of a short one is 4.6-4.8 KB)
STREAM_OVERHEAD = 4608


def retain(
    pipe: Any, keys: Keys, cfg: RedisConfig, model: str, ended: dict[str, list[tuple[str, int]]]
) -> None:
    """Queue, on the step's pipeline, the retention of the requests that ended in it:
    `ended` maps a tenant to its (request id, history bytes)."""
    now_ms = int(time.time() * 1000)
    retention_ms = int(cfg.stream_retention_s * 1000)
    prefixes = [keys.out(model, ""), keys.attached(model, "")]
    for tenant, requests in ended.items():
        kept = keys.retained(model, tenant)
        args = [now_ms, retention_ms, cfg.stream_retention_tenant_bytes, *prefixes]
        args += [x for rid, n in requests for x in (rid, n + STREAM_OVERHEAD)]
        pipe.execute_command("EVAL", STREAM_RETAIN, 2, kept, f"{kept}:b", *args)


async def retire(client: Any, keys: Keys, model: str, request_id: str, tenant: str) -> None:
    """The request's client has its whole answer: its keys go now."""
    kept = keys.retained(model, tenant)
    streams = [keys.out(model, request_id), keys.attached(model, request_id), kept, f"{kept}:b"]
    await eval_script(client, STREAM_RETIRE, streams, [request_id])


@dataclass(frozen=True, slots=True)
class Load:
    """A deployment's traffic, for `redis_memory` (docs/deployment.md, "Redis memory")."""

    tokens_per_s: float  # generated, every engine together
    bytes_per_token: int  # an event's share in a stream: 131 B a token, 459 B with logprobs: 20
    in_flight: int  # requests running at once (engines x --max-num-seqs)
    max_tokens: int  # what a running request's history may grow to
    tenants: int
    models: int = 1


def redis_memory(load: Load, cfg: RedisConfig, response_tenant_bytes: int) -> int:
    """What Redis holds at steady `load`, at most: the gateways' results streams (every
    event, for `results_tail_s`), the running requests' own streams (their whole answers
    so far), each tenant's kept streams of every model (`stream_retention_tenant_bytes`)
    and each tenant's stored responses (`--response-tenant-max-bytes`). The queue, the
    registry and the tenants' buckets are small beside them. docker-compose.yml's
    `maxmemory` must be at least this for the load it names (tests/integration/
    test_compose.py)."""
    results = load.tokens_per_s * cfg.results_tail_s * load.bytes_per_token
    running = load.in_flight * (load.max_tokens * load.bytes_per_token + STREAM_OVERHEAD)
    kept = load.tenants * load.models * cfg.stream_retention_tenant_bytes
    stored = load.tenants * response_tenant_bytes
    return int(results + running + kept + stored)
