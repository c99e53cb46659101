"""The Redis key layout (the Lua scripts that keep multi-key steps atomic are in
`lua/`, loaded by `redis_scripts.py`).

Every key starts with the deployment's prefix (`wsllm` by default) and carries a
Redis Cluster hash tag (`{...}`), so that a cluster keeps together what one command
or script touches:

    {p}:{model}:q           request stream of taken requests (and hand-backs); consumer
                            group `engines`, one consumer per engine
    {p}:{model}:q:...       the waiting requests (one sorted set shared by the engines and
                            one per engine that requests are routed to, ordered by each
                            member's header: priority, tenant virtual time, submit order),
                            the queue's counters, the engines' wake-up and the prefix
                            summaries (`redis_queue.py`, `prefix_routing.py`): suffixes of
                            the request stream's key
    {p}:{model}:o:{rid}     history stream of one request: a `meta` entry (the gateway's context,
                            the request entry's id, its gateway's results stream), then its
                            events, copied there every `history_flush_s` and when it ends
    {p}:{model}:r:{gateway} results stream of a gateway: one entry per engine step with that
                            step's TokenEvents for all the gateway's requests (trimmed by age,
                            `results_tail_s`); what the gateway reads live
    {p}:{model}:att:{rid}   how many times a client resumed the request: a grace abort goes
                            ahead only if nobody resumed it since the client it waits for left
    {p}:{model}:w:{gateway} a gateway's wake-up stream for this model (a new request to read)
    {p}:{model}:kept:{tenant} the tenant's ended requests whose history streams are kept for a
                            resume, by end time; `:b` their bytes, within the tenant's budget
    {p}:{model}:dead        dead-letter stream: queue and abort entries no engine can serve,
                            with the reason
    {p}:{model}:tok         the model's tokenizer files, published by its engines
    {p}:{model}:aborts      the model's abort stream, read by every engine of the model
    {p}:{p}:engines         set of engine ids; {p}:{p}:engine:{id} its heartbeat, with a TTL
    {p}:{t:tenant}:rpm      a tenant's requests bucket (hash: level, time), gone once it would be
    {p}:{t:tenant}:tpm      full again; its tokens bucket the same (`limits.py`)
    {p}:{t:tenant}:live     the tenant's in-flight requests: sorted set of request ids scored by
                            their lease's expiry, refreshed while they run
    {p}:{r:tenant}:resp:{id} a tenant's stored Responses answer (hash: record, or a tombstone),
                            with its TTL; {p}:{r:tenant}:resps and :rsizes its index and sizes,
                            for the tenant's budget (`redis_responses.py`)

Slots. A model's keys share the slot of `{model}`: the submit, take, abort and sweep
scripts, the gateway's blocking XREAD over its requests' result streams and its
wake-up stream and the engines' reads all stay inside it, so models spread over the
shards of a cluster. The abort stream is the model's too (every engine reads it
each loop: a deployment-wide one made one shard hot, docs/scaling.md), so the abort
script ends the request and tells its engines in one step. The engine registry shares
the slot of `{prefix}`, each tenant's limit keys the slot of `{t:tenant}` (every
lua/limit_*.lua script touches one tenant's keys only), and its stored responses the
slot of `{r:tenant}` (lua/response_*.lua). Moving a malformed abort entry to the
model's dead-letter stream is two commands: the XDEL that removes it decides which
engine moves it, once.

A model name must not contain `{` or `}` (they would change the hash tag).

docs/architecture.md (the broker section) explains the choice of one result stream
per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.exceptions

from wsllm.config_redis import RedisConfig

GROUP = "engines"

#: errors that mean "Redis cannot be reached now" (retry later), not "a bad command"
UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def client_options(cfg: RedisConfig, asyncio: bool = False, wait_s: float = 0.0) -> dict[str, Any]:
    """Connection settings for every client of the broker: a connect timeout and a
    socket timeout (`wait_s` more for a client whose reads block that long), so that a
    Redis that stops answering (paused, or its host gone) fails a command instead of
    hanging it; a short retry with a short backoff on a refused or broken connection,
    none on a timeout (a paused Redis would cost three timeouts), and the broker's own
    loops wait for Redis instead of redis-py's default of retrying one command for up
    to a minute."""
    import redis.asyncio.retry
    import redis.backoff
    import redis.retry

    retry_cls = redis.asyncio.retry.Retry if asyncio else redis.retry.Retry
    backoff = redis.backoff.ExponentialBackoff(cap=0.2, base=0.02)
    return {
        "socket_connect_timeout": cfg.redis_connect_timeout_s,
        "socket_timeout": cfg.redis_socket_timeout_s + wait_s,
        "retry": retry_cls(backoff, 2, supported_errors=(redis.exceptions.ConnectionError,)),
    }


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str

    def model_tag(self, model: str) -> str:
        """The start of every key of `model`: one cluster hash slot per model."""
        return f"{self.prefix}:{{{model}}}"

    @property
    def global_tag(self) -> str:
        """The start of the deployment-wide keys (the engine registry): a slot of its own."""
        return f"{self.prefix}:{{{self.prefix}}}"

    def queue(self, model: str) -> str:
        return f"{self.model_tag(model)}:q"

    def out(self, model: str, request_id: str) -> str:
        return f"{self.model_tag(model)}:o:{request_id}"

    def results(self, model: str, gateway_id: str) -> str:
        """The results stream of one gateway for one model: each engine step's events
        for all of that gateway's requests in one entry."""
        return f"{self.model_tag(model)}:r:{gateway_id}"

    def attached(self, model: str, request_id: str) -> str:
        return f"{self.model_tag(model)}:att:{request_id}"

    def wake(self, model: str, gateway_id: str) -> str:
        return f"{self.model_tag(model)}:w:{gateway_id}"

    def retained(self, model: str, tenant: str) -> str:
        """The ended requests of `tenant` whose history streams stay resumable (sorted set
        by end time; with `:b`, the hash of their bytes and `_` their sum:
        `redis_retention.py`)."""
        return f"{self.model_tag(model)}:kept:{tenant}"

    def dead(self, model: str) -> str:
        return f"{self.model_tag(model)}:dead"

    def tokenizer(self, model: str) -> str:
        """A model's tokenizer files (hash: file name -> bytes), published by its engines
        so that a gateway anywhere can load it."""
        return f"{self.model_tag(model)}:tok"

    def aborts(self, model: str) -> str:
        """The abort stream of `model`'s engines (in its slot: one per model)."""
        return f"{self.model_tag(model)}:aborts"

    @property
    def engines(self) -> str:
        return f"{self.global_tag}:engines"

    def engine(self, engine_id: str) -> str:
        return f"{self.global_tag}:engine:{engine_id}"

    def tenant(self, tenant: str, what: str) -> str:
        """A tenant's limit key: `rpm`, `tpm` (buckets) or `live` (in-flight leases)."""
        return f"{self.prefix}:{{t:{tenant}}}:{what}"

    def response(self, tenant: str, response_id: str) -> str:
        """A tenant's stored Responses answer (`redis_responses.py`)."""
        return f"{self.prefix}:{{r:{tenant}}}:resp:{response_id}"

    def responses(self, tenant: str, what: str) -> str:
        """A tenant's index of its stored answers: `resps` (by expiry), `rsizes` (bytes)."""
        return f"{self.prefix}:{{r:{tenant}}}:{what}"
