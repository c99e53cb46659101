"""The Redis queue of one model: priority levels, fair share by tenant, per-tenant
depth, and the target engine of a routed request (the rules are in `fair_queue.py`;
this module keeps them in Lua so that every gateway and engine applies them
atomically).

A request waits in the stream of its (priority, tenant) until an engine takes it;
taking moves it, in one script, into the model's request stream (`Keys.queue`) and
delivers it to the engine as a consumer of the `engines` group. So everything after
the take is unchanged: leases, XAUTOCLAIM recovery, hand-back (`release` adds to the
request stream, where the next take delivers it first), dead letters. Keys, all
suffixes of the request stream's key (so they share its Redis Cluster hash slot):

    {queue}:lv              sorted set of the priorities with waiting requests
    {queue}:rr:{prio}       sorted set: the tenants waiting at that priority, scored by
                            their virtual time (round robin)
    {queue}:clk             hash: each priority's clock (the time of the tenant served last)
    {queue}:wq:{prio}:{t}   stream of tenant t's waiting requests at that priority; each
                            entry is the request entry (r, i, d, s: its gateway's results
                            stream) and, when the gateway routed it, `e`: the engine it is
                            meant for (the take drops `e`, so the engine admits r, i, d, s)
    {queue}:nt              one-entry stream that wakes idle engines on a submit
    {queue}:seen            hash: per engine, its last take, its usual interval between
                            takes and whether its last take filled its room
    {queue}:tk              hash: request id -> its entry in the request stream, from the
                            take until the engine acks it (an abort deletes the entry
                            there once it left its waiting stream: `redis_keys.ABORT`)

A routed entry (`e`) is taken by its engine, or by any engine once it has waited
`steal_after_s` and its engine is busy (see TAKE): no request waits on a busy engine,
and none leaves an engine that is about to take it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: entries of a tenant's stream an engine looks through for one it may take
SCAN = 16
#: tenants of a level looked at per take (the rest wait their turn)
TENANTS = 64

# The waiting entries: the sum over every (priority, tenant) stream, and the tenant's.
# Sets `total` (plus the entries of the request stream not yet delivered: hand-backs)
# and `mine`. KEYS[1] is the request stream; ARGV[1] the group; `tenant` a local.
_COUNT = """
local q = KEYS[1]
local ok, pend = pcall(redis.call, 'XPENDING', q, ARGV[1])
if not ok then
  redis.call('XGROUP', 'CREATE', q, ARGV[1], '0', 'MKSTREAM')
  pend = {0}
end
local total, mine = redis.call('XLEN', q) - pend[1], 0
local levels, queued = {}, {}  -- the levels waiting; the levels where `tenant` waits
for _, l in ipairs(redis.call('ZRANGE', q .. ':lv', 0, -1)) do
  levels[l] = true
  for _, t in ipairs(redis.call('ZRANGE', q .. ':rr:' .. l, 0, -1)) do
    local n = redis.call('XLEN', q .. ':wq:' .. l .. ':' .. t)
    total = total + n
    if t == tenant then mine = mine + n; queued[l] = true end
  end
end
"""

# Admission and submit in one step: refuse past the depth or the tenant's share, else
# queue the request in its (priority, tenant) stream, open its history stream with the
# meta entry (`q`/`qe` name the waiting entry: an abort deletes it there, or, once
# taken, in the request stream `rq` through `{queue}:tk`; `s` the gateway's results
# stream) and wake the idle engines. The gateway reads its results
# stream all the time: it needs no wake-up.
# KEYS: queue, out   ARGV: group, depth, tenant cap, request, meta, ttl_ms, request
# id, deadline, priority, tenant, target engine ('' none), results stream
#   -> {1, waiting stream, entry id} or {0, count, 'depth' | 'tenant'}
SUBMIT = (
    "local tenant = ARGV[10]\n"
    + _COUNT
    + """
if total >= tonumber(ARGV[2]) then return {0, total, 'depth'} end
if mine >= tonumber(ARGV[3]) then return {0, mine, 'tenant'} end
local prio = ARGV[9]
local rr, w = q .. ':rr:' .. prio, q .. ':wq:' .. prio .. ':' .. tenant
local fields = {'r', ARGV[4], 'i', ARGV[7], 'd', ARGV[8], 's', ARGV[12]}
if ARGV[11] ~= '' then fields[#fields + 1] = 'e'; fields[#fields + 1] = ARGV[11] end
local id = redis.call('XADD', w, '*', unpack(fields))
if not levels[prio] then  -- a new level: no clock yet (a level's clock goes with it)
  redis.call('ZADD', rr, 0, tenant)
  redis.call('ZADD', q .. ':lv', prio, prio)
elseif not queued[prio] then
  redis.call('ZADD', rr, redis.call('HGET', q .. ':clk', prio) or 0, tenant)
end
redis.call('XADD', KEYS[2], '*', 'm', ARGV[5], 'q', w, 'qe', id, 's', ARGV[12], 'rq', q)
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('XADD', q .. ':nt', 'MAXLEN', '1', '*', 'x', '1')
return {1, w, id}
"""
)

# Waiting requests of the model (all tenants). KEYS: queue  ARGV: group  -> count
COUNT = "local tenant = ''\n" + _COUNT + "return total\n"

# An engine's take: up to ARGV[3] entries in turn (highest priority first, tenants
# round robin inside it), each one this engine may take, moved into the request stream;
# then one XREADGROUP delivers them (and any hand-back waiting there) to the engine.
# An entry routed to another engine is this one's once it has waited ARGV[5] ms and
# that engine is busy: its last take filled its room, or it has not taken for twice
# its usual interval between takes (it is mid-step, full, or gone). `{queue}:seen`
# keeps, per engine, its last take (ms), that interval (a moving average) and whether
# the take filled its room; the engine passes its own last take and interval back in
# (ARGV[8], ARGV[9]: they come back with the take's reply), so the script only writes.
# Every call is a command counted against each generated token: the script keeps what
# it learnt in locals (a tenant stream's length from its XRANGE, a level's clock until
# the level is done) instead of asking again.
# KEYS: queue   ARGV: group, consumer, count, engine id, steal_ms, scan, tenants,
#                     last take (ms, 0: none), interval (ms)
#   -> {now (ms), interval, XREADGROUP reply}
TAKE = """
local q, n, me = KEYS[1], tonumber(ARGV[3]), ARGV[4]
local steal, scan, width = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]) - 1
local seen = q .. ':seen'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local busy = {}
local function isBusy(e)
  if busy[e] == nil then
    local v = redis.call('HMGET', seen, e, e .. ':p', e .. ':f')
    local last, period = tonumber(v[1] or '0'), tonumber(v[2] or '0')
    busy[e] = last == 0 or v[3] == '1' or now - last >= math.max(steal, 2 * period)
  end
  return busy[e]
end
local function mayTake(id, f)
  for i = 1, #f, 2 do
    if f[i] == 'e' then
      local e = f[i + 1]
      if e == me then return true end
      return now - tonumber(string.match(id, '^(%d+)')) >= steal and isBusy(e)
    end
  end
  return true
end
-- one entry of the level's turn; returns taken, the tenant's new score (nil: none
-- taken), and whether the level's tenants are all gone
local function takeOne(prio, rr)
  local tenants = redis.call('ZRANGE', rr, 0, width, 'WITHSCORES')
  local left = #tenants / 2  -- tenants of the level still in rr (of those looked at)
  local all = #tenants / 2 <= width  -- the ZRANGE saw every tenant of the level
  for i = 1, #tenants, 2 do
    local tenant, score = tenants[i], tonumber(tenants[i + 1])
    local w = q .. ':wq:' .. prio .. ':' .. tenant
    local entries = redis.call('XRANGE', w, '-', '+', 'COUNT', scan)
    for _, e in ipairs(entries) do
      if mayTake(e[1], e[2]) then
        local f, moved, rid = e[2], {}, nil
        for j = 1, #f, 2 do
          if f[j] ~= 'e' then moved[#moved + 1] = f[j]; moved[#moved + 1] = f[j + 1] end
          if f[j] == 'i' then rid = f[j + 1] end
        end
        local id = redis.call('XADD', q, '*', unpack(moved))
        if rid then redis.call('HSET', q .. ':tk', rid, id) end
        if #entries == 1 then  -- it was the tenant's last waiting entry
          redis.call('DEL', w)
          redis.call('ZREM', rr, tenant)
          left = left - 1
        else
          redis.call('XDEL', w, e[1])
          redis.call('ZADD', rr, score + 1, tenant)
        end
        return true, score, all and left == 0
      end
    end
    if #entries == 0 then
      redis.call('DEL', w)
      redis.call('ZREM', rr, tenant)
      left = left - 1
    end
  end
  return false, nil, all and left == 0
end
local taken = 0
for _, prio in ipairs(redis.call('ZREVRANGE', q .. ':lv', 0, -1)) do
  local rr = q .. ':rr:' .. prio
  local clock, gone = nil, false
  while taken < n do
    local ok, score, empty = takeOne(prio, rr)
    if ok then taken = taken + 1; clock = score end
    gone = empty
    if not ok or empty then break end
  end
  if gone then  -- exact: takeOne saw every tenant of the level, or some stay
    redis.call('ZREM', q .. ':lv', prio)
    redis.call('HDEL', q .. ':clk', prio)
  elseif clock then
    redis.call('HSET', q .. ':clk', prio, clock)
  end
  if taken >= n then break end
end
local last, period = tonumber(ARGV[8]), tonumber(ARGV[9])
if last > 0 then period = 0.8 * period + 0.2 * math.min(now - last, 1000) end
if redis.call('HSET', seen, me, now, me .. ':p', period, me .. ':f', taken >= n and '1' or '0') > 0 then
  redis.call('PEXPIRE', seen, 3600000)  -- new fields: a new engine, or a new hash
end
local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', q, '>')
return {now, tostring(period), got}
"""

# Queue deadlines over the waiting streams: entries whose deadline `d` passed leave,
# and the history stream of each (if its client still has one) and its gateway's
# results stream `s` get the failure event, built around the JSON-quoted request id.
# KEYS: queue   ARGV: group, scan_limit, now, out key prefix, retention_ms,
#                     event before the id, event after the id, the model's key tag + ':'
#                     -> expired request ids
EXPIRE = """
local q, budget, now = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local expired = {}
for _, l in ipairs(redis.call('ZRANGE', q .. ':lv', 0, -1)) do
  for _, tenant in ipairs(redis.call('ZRANGE', q .. ':rr:' .. l, 0, -1)) do
    local w = q .. ':wq:' .. l .. ':' .. tenant
    if budget <= 0 then return expired end
    local entries = redis.call('XRANGE', w, '-', '+', 'COUNT', budget)
    budget = budget - #entries
    for _, e in ipairs(entries) do
      local f, d, rid, res = e[2], nil, nil, nil
      for i = 1, #f, 2 do
        if f[i] == 'd' then d = tonumber(f[i + 1]) elseif f[i] == 'i' then rid = f[i + 1]
        elseif f[i] == 's' then res = f[i + 1] end
      end
      if d and rid and d > 0 and d <= now then
        redis.call('XDEL', w, e[1])
        local out = ARGV[4] .. rid
        if redis.call('EXISTS', out) == 1 then
          local ev = ARGV[6] .. cjson.encode(rid) .. ARGV[7]
          redis.call('XADD', out, '*', 'e', ev)
          redis.call('PEXPIRE', out, ARGV[5])
          -- only a stream of this model's slot (the script's keys are all in it)
          if res and string.sub(res, 1, #ARGV[8]) == ARGV[8] then
            redis.call('XADD', res, '*', 'e', ev)
            if redis.call('PTTL', res) == -1 then redis.call('PEXPIRE', res, ARGV[5]) end
          end
        end
        expired[#expired + 1] = rid
      end
    end
  end
end
return expired
"""

# Best-effort places of waiting entries: 1 + everything waiting at higher priorities
# + (entries ahead in its own stream) x (tenants at its priority), as round robin
# serves them; 0 once taken (or gone).
# KEYS: queue   ARGV: scan, then (waiting stream, entry id) pairs   -> places
POSITIONS = """
local q, scan = KEYS[1], tonumber(ARGV[1])
local above = {}
local levels = redis.call('ZREVRANGE', q .. ':lv', 0, -1)
local sum = 0
for _, l in ipairs(levels) do
  above[l] = sum
  for _, t in ipairs(redis.call('ZRANGE', q .. ':rr:' .. l, 0, -1)) do
    sum = sum + redis.call('XLEN', q .. ':wq:' .. l .. ':' .. t)
  end
end
local out = {}
for i = 2, #ARGV, 2 do
  local w, id = ARGV[i], ARGV[i + 1]
  local prio = string.match(string.sub(w, #q + 5), '^([^:]+)')
  local ahead = redis.call('XRANGE', w, '-', id, 'COUNT', scan)
  if #ahead == 0 or ahead[#ahead][1] ~= id or not prio or not above[prio] then
    out[#out + 1] = 0
  else
    local tenants = redis.call('ZCARD', q .. ':rr:' .. prio)
    out[#out + 1] = above[prio] + (#ahead - 1) * math.max(1, tenants) + 1
  end
end
return out
"""


def taken_key(queue: str) -> str:
    """The hash of taken requests' entries in the request stream (see the module doc)."""
    return f"{queue}:tk"


def waiting_key(queue: str, priority: int, tenant: str) -> str:
    """The stream where `tenant`'s requests of `priority` wait (see the module doc)."""
    return f"{queue}:wq:{priority}:{tenant}"


class Taker:
    """An engine's takes from its model's queue (blocking redis-py, the worker's
    thread): `take(count, timeout)` returns the delivered entries, waiting up to
    `timeout` for a submit when none is there."""

    def __init__(self, r: Any, queue: str, group: str, consumer: str, steal_after_s: float) -> None:
        self.r = r
        self.queue = queue
        self.group = group
        self.consumer = consumer
        self.steal_ms = int(steal_after_s * 1000)
        self._take = r.register_script(TAKE)
        self._last = 0  # this engine's last take (Redis's clock, ms) and its usual interval
        self._period = 0.0

    def take(self, count: int, timeout: float, closed: threading.Event, slice_s: float) -> list[Any]:
        """Raw XREADGROUP entries: [(entry id, fields), ...]. Waits on the wake-up
        stream in slices of `slice_s` (so that `closed` is seen)."""
        deadline = time.monotonic() + timeout
        wake = self.queue + ":nt"
        while True:
            last = self.r.xrevrange(wake, count=1) if timeout > 0 else None
            args = [self.group, self.consumer, count, self.consumer, self.steal_ms, SCAN, TENANTS]
            now, period, resp = self._take(keys=[self.queue], args=[*args, self._last, self._period])
            self._last, self._period = int(now), float(period)
            # A script's reply is raw: each entry's fields come as a flat list.
            entries = [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in (resp[0][1] if resp else [])]
            left = deadline - time.monotonic()
            if entries or left <= 0.001 or closed.is_set():
                return entries
            # Routed entries of a busy peer become ours after steal_ms: look again by then.
            block = int(min(left, slice_s, max(self.steal_ms, 10) / 1000) * 1000)
            self.r.xread({wake: last[0][0] if last else "0-0"}, count=1, block=max(block, 1))


def submit_args(
    group: str,
    depth: int,
    cap: int,
    request: bytes,
    meta: bytes,
    ttl_ms: int,
    request_id: str,
    deadline: float,
    priority: int,
    tenant: str,
    target: str,
    results: str,
) -> list[Any]:
    """ARGV of SUBMIT, in order."""
    return [
        group, depth, cap, request, meta, ttl_ms, request_id, repr(deadline), priority, tenant, target, results,
    ]  # fmt: skip
