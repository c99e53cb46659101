-- An engine's take: the best ARGV[3] members (less the hand-backs waiting in the request
-- stream, which go first) among its own routed set, the shared set and the stealable
-- ones of its peers' routed sets, moved into the request stream in queue order; then
-- one XREADGROUP delivers them (and the hand-backs) to the engine. A peer's routed
-- request is stealable once it has waited ARGV[5] ms and its engine is busy: its last
-- take filled its room, or the request has waited twice that engine's usual interval
-- between iterations (the submit woke it: it would have taken the request by then
-- unless it is full, mid-step or gone). `{queue}:seen` keeps, per engine, that interval
-- (ms, measured by the engine itself) and whether its last take filled its room.
-- Every call is a command counted against each generated token: the engine calls it
-- only when a take may find something (see Taker), and the script asks Redis's clock
-- only when there is a peer's request to judge.
-- A take also clears the counters' `w` (a wake-up was sent and no engine has taken
-- since): a submit sends a wake-up only when none is pending.
-- A request for a LoRA adapter waits in the set of '@' .. adapter (the gateway routes it
-- there): the engines that hold the adapter take from it as from their own, and no other
-- engine ever steals from it.
-- KEYS: queue   ARGV: group, consumer, count, engine id, steal_ms, scan, interval (ms;
--                     '': unchanged since the engine last said), '1': read the request
--                     stream even if nothing moved, what the last take said of `full`,
--                     then the adapters the engine holds
--   -> {ms until routed requests of a peer may be stealable (-1: none), XREADGROUP reply}
-- (run after queue_lib.lua, whose functions it calls)
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
    for i = 10, #ARGV do
      local a = '@' .. ARGV[i]
      if (tonumber(redis.call('HGET', cnt, 'e:' .. a)) or 0) > 0 then
        add(q .. ':z:' .. a, redis.call('ZRANGE', q .. ':z:' .. a, 0, want - 1))
      end
    end
  end
  if routed - mine > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    for _, e in ipairs(redis.call('SMEMBERS', q .. ':ze')) do
      if e ~= me and string.sub(e, 1, 1) ~= '@' then  -- an adapter's set: its holders' alone
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
