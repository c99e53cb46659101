-- Queue deadlines over the waiting sets: members whose deadline passed leave, and the
-- history stream of each (if its client still has one) and its gateway's results
-- stream get the failure event, built around the JSON-quoted request id.
-- KEYS: queue   ARGV: scan_limit, now, out key prefix, retention_ms, event before the
--                     id, event after the id, the model's key tag + ':'
--                     -> expired request ids
-- (run after queue_lib.lua and queue_sets.lua, whose functions it calls)
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
