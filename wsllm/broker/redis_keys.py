"""The Redis key layout and the Lua scripts that keep multi-key steps atomic.

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
    {p}:{model}:dead        dead-letter stream: queue and abort entries no engine can serve,
                            with the reason
    {p}:{model}:tok         the model's tokenizer files, published by its engines
    {p}:{model}:aborts      the model's abort stream, read by every engine of the model
    {p}:{p}:engines         set of engine ids; {p}:{p}:engine:{id} its heartbeat, with a TTL
    {p}:{t:tenant}:rpm      a tenant's requests bucket (hash: level, time), gone once it would be
    {p}:{t:tenant}:tpm      full again; its tokens bucket the same (`limits.py`)
    {p}:{t:tenant}:live     the tenant's in-flight requests: sorted set of request ids scored by
                            their lease's expiry, refreshed while they run
    {p}:resp:{id}           a stored Responses answer (hash: tenant, record), with its TTL

Slots. A model's keys share the slot of `{model}`: the submit, take, abort and sweep
scripts, the gateway's blocking XREAD over its requests' result streams and its
wake-up stream and the engines' reads all stay inside it, so models spread over the
shards of a cluster. The abort stream is the model's too (every engine reads it
each loop: a deployment-wide one made one shard hot, docs/scaling.md), so the abort
script ends the request and tells its engines in one step. The engine registry shares
the slot of `{prefix}`, and each tenant's limit keys the slot of `{t:tenant}` (every
LIMIT_* script touches one tenant's keys only). Moving a malformed abort entry to the
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

    def response(self, response_id: str) -> str:
        """A stored Responses answer (`redis_responses.py`)."""
        return f"{self.prefix}:resp:{response_id}"


# Submit, the engines' take, the queue-deadline sweep, queue positions and the abort
# of a request are in `redis_queue.py` (priority levels, tenants in turn, routed
# requests), all in the model's slot: their keys are suffixes of `Keys.queue(model)`.

# Live engines: the ids whose heartbeat key still exists, with its payload and the
# milliseconds it has left; ids whose key expired leave the set.
# KEYS: engines set   ARGV: engine key prefix
ENGINES = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local k = ARGV[1] .. id
  local v = redis.call('GET', k)
  if v then
    out[#out + 1] = v
    out[#out + 1] = redis.call('PTTL', k)
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""

# Lease refresh: reset the idle time of the entries this engine still owns (so that
# XAUTOCLAIM leaves them alone), and report those it does not own any more. One XPENDING
# of this consumer's entries and one XCLAIM per 1000 of them, whatever their number.
# KEYS: queue   ARGV: group, consumer, scan limit, entry ids...   -> ids no longer ours
REFRESH = """
local mine = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', ARGV[3], ARGV[2])) do
  mine[p[1]] = true
end
local lost, keep = {}, {}
for i = 4, #ARGV do
  if mine[ARGV[i]] then keep[#keep + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
for i = 1, #keep, 1000 do
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #keep) do args[#args + 1] = keep[j] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return lost
"""

# Rate limits (wsllm/broker/limits.py has the rules). Time is Redis's own (TIME), so
# gateways with skewed clocks still agree. A bucket is a hash {l: level, t: ms}; a missing
# one is full, and each expires once it would be full again. Limits of 0 mean none.
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, cap, window)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / window)
end
local function store(key, l, window)
  redis.call('HSET', key, 'l', tostring(l), 't', now)
  redis.call('PEXPIRE', key, window + 1000)
end
"""

# Check and take, all or nothing: one request, `charge` tokens, a lease on `request_id`.
# KEYS: rpm bucket, tpm bucket, live set   ARGV: rpm, tpm, max_concurrent, charge,
# request_id, lease_ms, window_ms   -> {refused reason or '', wait_ms, rpm level, tpm level}
LIMIT_ACQUIRE = (
    _BUCKET
    + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local charge, lease, window = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
local r, k = level(KEYS[1], rpm, window), level(KEYS[2], tpm, window)
local reason, wait = '', 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  -- a request that holds its lease already (its client resumes it) does not count twice
  local held = redis.call('ZSCORE', KEYS[3], ARGV[5])
  if not held and redis.call('ZCARD', KEYS[3]) >= conc then reason, wait = 'concurrent', 1000 end
end
if reason == '' and rpm > 0 and r < 1 then
  reason, wait = 'requests', (1 - r) * window / rpm
elseif reason == '' and tpm > 0 and k < charge then
  reason, wait = 'tokens', (charge - k) * window / tpm
end
if reason == '' then
  if rpm > 0 then r = r - 1; store(KEYS[1], r, window) end
  if tpm > 0 then k = k - charge; store(KEYS[2], k, window) end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now + lease, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], lease)
  end
end
return {reason, tostring(wait), tostring(r), tostring(k)}
"""
)

# A request ended: drop its lease, give `refund` tokens back (up to the capacity).
# KEYS: tpm bucket, live set   ARGV: tpm, refund, request_id, window_ms
LIMIT_RELEASE = (
    _BUCKET
    + """
redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, refund, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if tpm > 0 and refund > 0 then store(KEYS[1], math.min(tpm, level(KEYS[1], tpm, window) + refund), window) end
return 1
"""
)

# Take `tokens` more from the tokens bucket (negative: give back, up to the capacity).
# It may go below zero: a debt that the next requests wait out.
# KEYS: tpm bucket   ARGV: tpm (> 0), tokens, window_ms   -> the level after
LIMIT_ADJUST = (
    _BUCKET
    + """
local tpm, tokens, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local k = math.min(tpm, level(KEYS[1], tpm, window) - tokens)
store(KEYS[1], k, window)
return tostring(k)
"""
)

# A tenant's buckets and live leases, read only.
# KEYS: rpm bucket, tpm bucket, live set   ARGV: rpm, tpm, window_ms -> {rpm level, tpm level, leases}
LIMIT_USAGE = (
    _BUCKET
    + """
local window = tonumber(ARGV[3])
local r, k = level(KEYS[1], tonumber(ARGV[1]), window), level(KEYS[2], tonumber(ARGV[2]), window)
return {tostring(r), tostring(k), redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')}
"""
)

# Extend the leases of requests still running here (XX: a released one stays released).
# KEYS: live set   ARGV: lease_ms, request ids...
LIMIT_REFRESH = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""
