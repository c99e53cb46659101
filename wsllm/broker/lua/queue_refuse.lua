-- Refuse every request waiting in one routed set (an adapter's, `@name`, that no engine
-- holds any more: nothing would take them): each leaves, and its history stream (if its
-- client still has one) and its gateway's results stream get the failure event, built
-- around the JSON-quoted request id, as the deadline sweep does (queue_expire.lua).
-- KEYS: queue   ARGV: the set's engine part ('@' .. adapter), out key prefix, retention_ms,
--                     event before the id, event after the id, the model's key tag + ':'
--                     -> the refused request ids
-- (run after queue_lib.lua, whose functions it calls)
local q = KEYS[1]
local set = q .. ':z:' .. ARGV[1]
local refused, gone = {}, {}
local members = redis.call('ZRANGE', set, 0, -1)
for _, m in ipairs(members) do
  local rid, res, tenant, eng = body(m)
  gone[#gone + 1] = {hprio(m), tenant, eng}
  local out = ARGV[2] .. rid
  if redis.call('EXISTS', out) == 1 then
    local ev = ARGV[4] .. cjson.encode(rid) .. ARGV[5]
    redis.call('XADD', out, '*', 'e', ev)
    redis.call('PEXPIRE', out, ARGV[3])
    if res ~= '' and string.sub(res, 1, #ARGV[6]) == ARGV[6] then
      redis.call('XADD', res, '*', 'e', ev)
      if redis.call('PTTL', res) == -1 then redis.call('PEXPIRE', res, ARGV[3]) end
    end
  end
  refused[#refused + 1] = rid
end
for i = 1, #members, 1000 do redis.call('ZREM', set, unpack(members, i, math.min(i + 999, #members))) end
if #gone > 0 then forget(q, gone) end
return refused
