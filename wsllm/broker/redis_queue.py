"""The Redis queue of one model: priority levels, fair share by tenant, per-tenant
depth, and the target engine of a routed request (the rules are in `fair_queue.py`;
this module keeps them in Lua so that every gateway and engine applies them
atomically).

A waiting request is one member of a sorted set, and its place in the queue is the
member's own bytes: every member has the score 0, so the set orders them by a fixed
header (inverted priority, then the tenant's virtual time, then the submit order),
and the request itself follows the header. Submitting gives a request its virtual
time at once: the next of its tenant's at that priority, or the level's clock when
the tenant has none waiting there (it joins now: next in turn, no banked turns), so
taking in member order is round robin by tenant inside a level, highest level first.
An engine's take pops the best members for all its free slots in one script and
moves them, in that script, into the model's request stream (`Keys.queue`), which
delivers them to the engine as a consumer of the `engines` group: everything after
the take is unchanged (leases, XAUTOCLAIM recovery, hand-back, dead letters).
Counters replace scans: the submit reads and writes one hash, so its cost does not
grow with the queue. Keys, all suffixes of the request stream's key (so they share
its Redis Cluster hash slot):

    {queue}:z               sorted set of the waiting requests any engine may take
    {queue}:z:{engine}      those routed to `engine` (prefix routing): it takes them
                            first, any engine once they waited `steal_after_s` and it
                            is busy (see TAKE)
    {queue}:ze              set of the engines with routed requests waiting
    {queue}:n               hash of counters: n (waiting), h (hand-backs not yet
                            delivered), rt (routed), s (submit order), and per tenant
                            t:{tenant}, per level l:{prio} and its clock c:{prio}, per
                            (level, tenant) k:{prio}:{tenant} and its last virtual time
                            v:{prio}:{tenant}, per engine e:{engine}, and w (a wake-up
                            was sent and no take has run since); gone once nothing
                            waits
    {queue}:nt              one-entry stream that wakes engines on a submit (idle ones
                            block on it; busy ones read it with the abort stream); a
                            submit writes it only when no wake-up is pending (`w`)
    {queue}:seen            hash: per engine, its last take, its usual interval between
                            takes and whether its last take filled its room
    {queue}:rc              recovery's turn: the engine that scans the request stream's
                            pending list in this interval (`redis_recovery.py`); expires
                            by itself
    {queue}:tk              hash: request id -> its entry in the request stream, from the
                            take until the engine acks it (an abort deletes the entry
                            there once it left the waiting set: `ABORT`)

A member is `HEADER` (54 bytes: 7 digits of 1,000,000 - priority, 15 of virtual time,
12 of submit order, 20 of queue deadline) followed by the MessagePack of (request id,
results stream, tenant, routed engine or '', submit time in ms, request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: entries of a busy peer's routed set an engine looks through for ones it may steal
SCAN = 16
#: a take is due at least this often while an engine has room, wake-up or not
_TAKE_EVERY_S = 5.0

# Helpers of every queue script. `forget` updates the counters for members that left
# the waiting sets (taken, aborted, expired); each is {priority, tenant, engine, tag}
# (tag: the virtual time of a taken one, which moves its level's clock on; nil else).
_LIB = """
local H = 54
local function hprio(m) return 1000000 - tonumber(string.sub(m, 1, 7)) end
local function htag(m) return tonumber(string.sub(m, 8, 22)) end
local function hdeadline(m) return tonumber(string.sub(m, 35, 54)) end
-- request id, results stream, tenant, engine, submit time (ms), request
local function body(m) return cmsgpack.unpack(string.sub(m, H + 1)) end
local function forget(q, gone, known)
  if #gone == 0 then return end
  local cnt = q .. ':n'
  if known then  -- {n, rt, h} as read in this script: when nothing is left, skip the read
    local routed = 0
    for _, g in ipairs(gone) do if g[3] ~= '' then routed = routed + 1 end end
    if known[1] - #gone <= 0 and known[2] - routed <= 0 and known[3] <= 0 then
      redis.call('DEL', cnt, q .. ':ze')
      return
    end
  end
  local names, at = {'n', 'rt', 'h'}, {n = 1, rt = 2, h = 3}
  local function want(f) if not at[f] then names[#names + 1] = f; at[f] = #names end end
  for _, g in ipairs(gone) do
    want('t:' .. g[2]); want('k:' .. g[1] .. ':' .. g[2]); want('l:' .. g[1]); want('c:' .. g[1])
    if g[3] ~= '' then want('e:' .. g[3]) end
  end
  local got = redis.call('HMGET', cnt, unpack(names))
  local v = {}
  for i, f in ipairs(names) do v[f] = tonumber(got[i]) or 0 end
  for _, g in ipairs(gone) do
    local p, t, e = g[1], g[2], g[3]
    v.n = v.n - 1
    v['t:' .. t] = v['t:' .. t] - 1
    v['k:' .. p .. ':' .. t] = v['k:' .. p .. ':' .. t] - 1
    v['l:' .. p] = v['l:' .. p] - 1
    if g[4] and g[4] > v['c:' .. p] then v['c:' .. p] = g[4] end
    if e ~= '' then v.rt = v.rt - 1; v['e:' .. e] = v['e:' .. e] - 1 end
  end
  local set, del, idle = {}, {}, {}
  for _, f in ipairs(names) do
    local kind, rest = string.match(f, '^(%a+):?(.*)$')
    local x = v[f]
    if kind == 'c' then x = (v['l:' .. rest] > 0) and x or 0 end  -- an empty level's clock goes
    if x > 0 or (kind == 'c' and v['l:' .. rest] > 0) then
      set[#set + 1] = f; set[#set + 1] = x
    else
      del[#del + 1] = f
      if kind == 'k' then del[#del + 1] = 'v:' .. rest end  -- the tenant left the level
      if kind == 'e' then idle[#idle + 1] = rest end
    end
  end
  if v.n <= 0 and v.h <= 0 and v.rt <= 0 then  -- nothing waits: the counters go
    redis.call('DEL', cnt, q .. ':ze')
    return
  end
  del[#del + 1] = 'w'  -- engines took (or the queue changed) since the last wake-up
  if #set > 0 then redis.call('HSET', cnt, unpack(set)) end
  redis.call('HDEL', cnt, unpack(del))
  if #idle > 0 then redis.call('SREM', q .. ':ze', unpack(idle)) end
end
"""

# Admission and submit in one step: refuse past the depth (waiting + hand-backs) or the
# tenant's share, else give the request its place (see the module doc), open its
# history stream with the meta entry (`q`/`qe`: the set it waits in and its header,
# so an abort finds it there, or, once taken, in the request stream `rq` through
# `{queue}:tk`; `s` the gateway's results stream), and wake the engines. The gateway
# reads its results stream all the time: it needs no wake-up.
# KEYS: queue, out   ARGV: depth, tenant cap, request, meta, ttl_ms, request id,
#                          deadline, priority, tenant, target engine ('' none), results
#   -> {1, waiting set, header} or {0, count, 'depth' | 'tenant'}
SUBMIT = (
    _LIB
    + """
local q, out = KEYS[1], KEYS[2]
local cnt = q .. ':n'
local prio, tenant, eng = tonumber(ARGV[8]), ARGV[9], ARGV[10]
local pt = prio .. ':' .. tenant
local got = redis.call('HMGET', cnt, 'n', 'h', 't:' .. tenant, 'k:' .. pt, 'v:' .. pt, 'c:' .. prio,
  'l:' .. prio, 's', 'rt', 'e:' .. eng, 'w')
local v = {}
for i = 1, 11 do v[i] = tonumber(got[i]) or 0 end
local n, h, mine, k, last, clock, l, s, rt, e, woken = unpack(v)
if n + h >= tonumber(ARGV[1]) then return {0, n + h, 'depth'} end
if mine >= tonumber(ARGV[2]) then return {0, mine, 'tenant'} end
local tag = clock
if k > 0 then tag = last + 1 end
local set = q .. ':z'
if eng ~= '' then set = set .. ':' .. eng end
local deadline = math.min(math.max(tonumber(ARGV[7]) or 0, 0), 1e12)
local hdr = string.format('%07d%015d%012d%020.6f', 1000000 - prio, tag, s + 1, deadline)
local id = redis.call('XADD', out, '*', 'm', ARGV[4], 'q', set, 'qe', hdr, 's', ARGV[11], 'rq', q)
redis.call('PEXPIRE', out, ARGV[5])
local at = tonumber(string.match(id, '^(%d+)'))
redis.call('ZADD', set, 0, hdr .. cmsgpack.pack(ARGV[6], ARGV[11], tenant, eng, at, ARGV[3]))
local upd = {'n', n + 1, 't:' .. tenant, mine + 1, 'k:' .. pt, k + 1, 'v:' .. pt, tag, 'l:' .. prio, l + 1,
  's', s + 1}
if eng ~= '' then
  upd[#upd + 1] = 'rt'; upd[#upd + 1] = rt + 1; upd[#upd + 1] = 'e:' .. eng; upd[#upd + 1] = e + 1
  if e == 0 then redis.call('SADD', q .. ':ze', eng) end
end
if woken == 0 then  -- no wake-up since the last take: send one (every take clears `w`)
  upd[#upd + 1] = 'w'; upd[#upd + 1] = 1
  redis.call('XADD', q .. ':nt', 'MAXLEN', '1', '*', 'x', '1')
end
redis.call('HSET', cnt, unpack(upd))
return {1, set, hdr}
"""
)

# An engine's take: the best ARGV[3] members (less the hand-backs waiting in the request
# stream, which go first) among its own routed set, the shared set and the stealable
# ones of its peers' routed sets, moved into the request stream in queue order; then
# one XREADGROUP delivers them (and the hand-backs) to the engine. A peer's routed
# request is stealable once it has waited ARGV[5] ms and its engine is busy: its last
# take filled its room, or the request has waited twice that engine's usual interval
# between iterations (the submit woke it: it would have taken the request by then
# unless it is full, mid-step or gone). `{queue}:seen` keeps, per engine, that interval
# (ms, measured by the engine itself) and whether its last take filled its room.
# Every call is a command counted against each generated token: the engine calls it
# only when a take may find something (see Taker), and the script asks Redis's clock
# only when there is a peer's request to judge.
# A take also clears the counters' `w` (a wake-up was sent and no engine has taken
# since): a submit sends a wake-up only when none is pending.
# KEYS: queue   ARGV: group, consumer, count, engine id, steal_ms, scan, interval (ms;
#                     '': unchanged since the engine last said), '1': read the request
#                     stream even if nothing moved, what the last take said of `full`
#   -> {ms until routed requests of a peer may be stealable (-1: none), XREADGROUP reply}
TAKE = (
    _LIB
    + """
local q, n, me = KEYS[1], tonumber(ARGV[3]), ARGV[4]
local steal, scan = tonumber(ARGV[5]), tonumber(ARGV[6])
local cnt, seen = q .. ':n', q .. ':seen'
local c = redis.call('HMGET', cnt, 'n', 'rt', 'h', 'e:' .. me, 'w')
local waiting, routed, handed, mine = tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]) or 0,
  tonumber(c[4]) or 0
local want = n - handed
local retry = -1
local function later(ms) if retry < 0 or ms < retry then retry = ms end end
local taken = 0
if waiting > 0 and want > 0 then
  local cands = {}
  local function add(set, members)
    for _, m in ipairs(members) do cands[#cands + 1] = {string.sub(m, 1, 34), set, m} end
  end
  if mine > 0 then
    local own = q .. ':z:' .. me
    add(own, redis.call('ZRANGE', own, 0, want - 1))
  end
  if waiting - routed > 0 then add(q .. ':z', redis.call('ZRANGE', q .. ':z', 0, want - 1)) end
  if routed - mine > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    for _, e in ipairs(redis.call('SMEMBERS', q .. ':ze')) do
      if e ~= me then
        local v = redis.call('HMGET', seen, e .. ':p', e .. ':f')
        local wait = steal  -- a peer never seen, or full: busy
        if v[1] and v[2] ~= '1' then wait = math.max(steal, 2 * tonumber(v[1])) end
        local set = q .. ':z:' .. e
        for _, m in ipairs(redis.call('ZRANGE', set, 0, scan - 1)) do
          local _, _, _, _, at = body(m)
          if now - at >= wait then add(set, {m}) else later(wait - (now - at)) end
        end
      end
    end
  end
  table.sort(cands, function(a, b) return a[1] < b[1] end)
  local tk, gone, bySet = {}, {}, {}
  for i = 1, math.min(want, #cands) do
    local set, m = cands[i][2], cands[i][3]
    local rid, res, tenant, eng, _, r = body(m)
    local id = redis.call('XADD', q, '*', 'r', r, 'i', rid, 'd', string.sub(m, 35, 54), 's', res)
    tk[#tk + 1] = rid; tk[#tk + 1] = id
    gone[#gone + 1] = {hprio(m), tenant, eng, htag(m)}
    bySet[set] = bySet[set] or {}
    table.insert(bySet[set], m)
  end
  for set, ms in pairs(bySet) do redis.call('ZREM', set, unpack(ms)) end
  if #tk > 0 then redis.call('HSET', q .. ':tk', unpack(tk)) end
  forget(q, gone, {waiting, routed, handed})
  taken = #gone
end
if taken == 0 and c[5] then redis.call('HDEL', cnt, 'w') end  -- this take saw the wake-up
local full = taken + handed >= n and '1' or '0'
if ARGV[7] ~= '' or full ~= ARGV[9] then  -- what peers know of this engine changed
  local f = {me .. ':f', full}
  if ARGV[7] ~= '' then f[3] = me .. ':p'; f[4] = ARGV[7] end
  if redis.call('HSET', seen, unpack(f)) > 0 then
    redis.call('PEXPIRE', seen, 3600000)  -- new fields: a new engine, or a new hash
  end
end
local got = false
if taken > 0 or handed > 0 or ARGV[8] == '1' then
  local args = {'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', q, '>'}
  local ok
  ok, got = pcall(redis.call, unpack(args))
  if not ok then  -- no group (a new model, or Redis restarted): make it and read again
    redis.call('XGROUP', 'CREATE', q, ARGV[1], '0', 'MKSTREAM')
    got = redis.call(unpack(args))
  end
end
if handed > 0 and got then  -- hand-backs delivered: no longer waiting
  local back = 0
  for _, entry in ipairs(got[1][2]) do
    for j = 1, #entry[2], 2 do if entry[2][j] == 'h' then back = back + 1 end end
  end
  if back > 0 then
    if redis.call('HINCRBY', cnt, 'h', -back) <= 0 then
      redis.call('HDEL', cnt, 'h')
      if waiting - taken <= 0 then redis.call('DEL', cnt, q .. ':ze') end
    end
  end
end
return {retry, got}
"""
)

# The waiting sets of a model: the shared one and the routed ones. KEYS[1] is the queue.
_SETS = """
local function sets(q)
  local out = {q .. ':z'}
  for _, e in ipairs(redis.call('SMEMBERS', q .. ':ze')) do out[#out + 1] = q .. ':z:' .. e end
  return out
end
"""

# Queue deadlines over the waiting sets: members whose deadline passed leave, and the
# history stream of each (if its client still has one) and its gateway's results
# stream get the failure event, built around the JSON-quoted request id.
# KEYS: queue   ARGV: scan_limit, now, out key prefix, retention_ms, event before the
#                     id, event after the id, the model's key tag + ':'
#                     -> expired request ids
EXPIRE = (
    _LIB
    + _SETS
    + """
local q, budget, now = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local expired, gone = {}, {}
if not redis.call('HGET', q .. ':n', 'n') then return expired end
for _, set in ipairs(sets(q)) do
  if budget <= 0 then break end
  local members = redis.call('ZRANGE', set, 0, budget - 1)
  budget = budget - #members
  local drop = {}
  for _, m in ipairs(members) do
    local d = hdeadline(m)
    if d > 0 and d <= now then
      local rid, res, tenant, eng = body(m)
      drop[#drop + 1] = m
      gone[#gone + 1] = {hprio(m), tenant, eng}
      local out = ARGV[3] .. rid
      if redis.call('EXISTS', out) == 1 then
        local ev = ARGV[5] .. cjson.encode(rid) .. ARGV[6]
        redis.call('XADD', out, '*', 'e', ev)
        redis.call('PEXPIRE', out, ARGV[4])
        -- only a stream of this model's slot (the script's keys are all in it)
        if res ~= '' and string.sub(res, 1, #ARGV[7]) == ARGV[7] then
          redis.call('XADD', res, '*', 'e', ev)
          if redis.call('PTTL', res) == -1 then redis.call('PEXPIRE', res, ARGV[4]) end
        end
      end
      expired[#expired + 1] = rid
    end
  end
  for i = 1, #drop, 1000 do redis.call('ZREM', set, unpack(drop, i, math.min(i + 999, #drop))) end
end
forget(q, gone)
return expired
"""
)

# Best-effort places of waiting requests: 1 + the members ahead of it (in queue order)
# in every waiting set; 0 once taken (or gone).
# KEYS: queue   ARGV: (waiting set, header) pairs   -> places
POSITIONS = (
    _SETS
    + """
local q = KEYS[1]
local all = sets(q)
local out = {}
for i = 1, #ARGV, 2 do
  local set, hdr = ARGV[i], ARGV[i + 1]
  if redis.call('ZLEXCOUNT', set, '[' .. hdr, '(' .. hdr .. '\\255') == 0 then
    out[#out + 1] = 0
  else
    local ahead = 0
    for _, s in ipairs(all) do ahead = ahead + redis.call('ZLEXCOUNT', s, '-', '(' .. hdr) end
    out[#out + 1] = ahead + 1
  end
end
return out
"""
)

# Abort from any gateway, the request's part (its model's slot): drop the request where
# it waits (its meta entry names the set and the header), or in the request stream once
# taken (so that a request whose engine is gone leaves nothing behind), and end the
# history stream and its gateway's results stream with a whole-request abort marker (a
# resumed client sees the end). A grace abort passes ARGV[4], the attach count its
# client had: it does nothing when a client resumed the request since (the count moved
# on). Then it tells the model's engines (its abort stream).
# KEYS: out, attached, aborts   ARGV: rid, retention_ms, marker, attach ('' = always),
#                               results ttl_ms, aborts maxlen
ABORT = (
    _LIB
    + """
if ARGV[4] ~= '' and (redis.call('GET', KEYS[2]) or '0') ~= ARGV[4] then return 0 end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if #first == 0 then return -1 end
local f = first[1][2]
local set, hdr, s, rq
for i = 1, #f, 2 do
  if f[i] == 'q' then set = f[i + 1] elseif f[i] == 'qe' then hdr = f[i + 1] elseif f[i] == 's' then s = f[i + 1]
  elseif f[i] == 'rq' then rq = f[i + 1] end
end
if set and hdr and rq then
  local m = redis.call('ZRANGEBYLEX', set, '[' .. hdr, '(' .. hdr .. '\\255', 'LIMIT', 0, 1)[1]
  if m then
    redis.call('ZREM', set, m)
    local _, _, tenant, eng = body(m)
    forget(rq, {{hprio(m), tenant, eng}})
  else
    -- taken: the take moved it into the request stream `rq` under a new id (TAKE)
    local te = redis.call('HGET', rq .. ':tk', ARGV[1])
    if te then
      redis.call('XDEL', rq, te)
      redis.call('HDEL', rq .. ':tk', ARGV[1])
    end
  end
end
redis.call('XADD', KEYS[1], '*', 'e', ARGV[3])
if s then
  redis.call('XADD', s, '*', 'e', ARGV[3])
  if redis.call('PTTL', s) == -1 then redis.call('PEXPIRE', s, ARGV[5]) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'r', ARGV[1])
return 1
"""
)


def taken_key(queue: str) -> str:
    """The hash of taken requests' entries in the request stream (see the module doc)."""
    return f"{queue}:tk"


def counters_key(queue: str) -> str:
    """The hash of the queue's counters (see the module doc)."""
    return f"{queue}:n"


def wake_key(queue: str) -> str:
    """The stream that wakes the model's engines on a submit or a hand-back."""
    return f"{queue}:nt"


def waiting_key(queue: str, engine: str = "") -> str:
    """The sorted set where requests routed to `engine` wait ('': any engine's)."""
    return f"{queue}:z:{engine}" if engine else f"{queue}:z"


class Taker:
    """An engine's takes from its model's queue (blocking redis-py, the worker's
    thread): `take(count, timeout)` returns the delivered entries, waiting up to
    `timeout` for a submit when none is there.

    A take is one script (about ten commands inside), so the engine runs it only when
    it may find something: the wake-up stream moved since the last take (a submit or
    a hand-back: the engine reads it each iteration together with the abort stream,
    one command, and hands what it read to `woken`), the last take filled its count, a
    peer's routed requests may have become stealable, or `_TAKE_EVERY_S` passed."""

    def __init__(self, r: Any, queue: str, group: str, consumer: str, steal_after_s: float) -> None:
        self.r = r
        self.queue = queue
        self.wake = wake_key(queue)
        self.group = group
        self.consumer = consumer
        self.steal_ms = int(steal_after_s * 1000)
        self._take = r.register_script(TAKE)
        self.cursor: str | None = None  # the newest wake-up entry seen (None: not read yet)
        self._cursor_at_take: str | None = ""  # the cursor when the last take was sent
        self._due = 0.0  # a take is due by this time (monotonic) whatever the wake-up says
        self._more = True  # the last take filled its count: more may wait
        self._tick = 0.0  # the engine's last iteration (monotonic) and its usual interval (ms)
        self._period = 0.0
        self._told: tuple[int, float] = (-1, 0.0)  # the interval peers know of, and since when
        self.takes = 0

    def tick(self) -> None:
        """One iteration of the engine (each pull): its usual interval between them is
        what peers wait, twice over, before they take a request routed to it."""
        now = time.monotonic()
        if self._tick:
            self._period = 0.8 * self._period + 0.2 * min((now - self._tick) * 1000, 1000.0)
        self._tick = now

    def woken(self, entry_id: str) -> None:
        """The newest wake-up entry, read with the abort stream."""
        self.cursor = entry_id

    @property
    def more(self) -> bool:
        """The last take filled its count: more requests may wait."""
        return self._more

    def due(self) -> bool:
        return self._more or self.cursor != self._cursor_at_take or time.monotonic() >= self._due

    def take(
        self,
        count: int,
        timeout: float,
        closed: threading.Event,
        slice_s: float,
        wait: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """Raw XREADGROUP entries: [(entry id, fields), ...]. Waits on the wake-up
        stream in slices of `slice_s` (so that `closed` is seen); `wait(ms)`, when
        given, is the blocking read instead (the engine's: it reads the abort stream too,
        and hands the wake-up to `woken`)."""
        deadline = time.monotonic() + timeout
        if self.cursor is None:
            last = self.r.xrevrange(self.wake, count=1)
            self.cursor = last[0][0].decode() if last else "0-0"
        while True:
            entries: list[Any] = []
            if self.due():
                entries = self._once(count)
            left = deadline - time.monotonic()
            if entries or left <= 0.001 or closed.is_set():
                return entries
            block = min(left, slice_s, max(self._due - time.monotonic(), 0.001))
            if wait is not None:
                wait(max(int(block * 1000), 1))
                continue
            resp = self.r.xread({self.wake: self.cursor}, count=1, block=max(int(block * 1000), 1))
            if resp:
                self.cursor = resp[0][1][-1][0].decode()

    def _once(self, count: int) -> list[Any]:
        now = time.monotonic()
        cursor, periodic = self.cursor, now >= self._due
        # Peers need this engine's interval when it moved by a quarter, or a while since.
        period = round(self._period)
        told, told_at = self._told
        tell = abs(period - told) > max(told / 4, 5) or now - told_at >= _TAKE_EVERY_S
        if tell:
            self._told = (period, now)
        args = [self.group, self.consumer, count, self.consumer, self.steal_ms, SCAN, period if tell else ""]
        # Read the request stream even if nothing moves now after a take that filled its
        # count (what it moved may wait there still), and now and then.
        args += ["1" if periodic or self._more else "", "1" if self._more else "0"]
        retry, resp = self._take(keys=[self.queue], args=args)
        self.takes += 1
        self._cursor_at_take = cursor
        # A script's reply is raw: each entry's fields come as a flat list.
        entries = [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in (resp[0][1] if resp else [])]
        self._more = len(entries) >= count
        wait_s = _TAKE_EVERY_S if int(retry) < 0 else max(int(retry), 5) / 1000
        self._due = time.monotonic() + wait_s
        return entries


def submit_args(
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
    return [depth, cap, request, meta, ttl_ms, request_id, repr(deadline), priority, tenant, target, results]
