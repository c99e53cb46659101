-- An engine step's ended requests of one tenant, kept for a resume within the tenant's
-- budget of bytes: each is recorded (its end time, its history stream's bytes) unless its
-- stream is gone already (its client took the whole answer: stream_retire.lua); records
-- past the retention are forgotten (their streams expired by themselves); then, while the
-- tenant's sum is over its budget, its oldest kept stream goes, and its resume count.
-- KEYS: the tenant's kept set, its bytes hash (`_`: their sum)
-- ARGV: now (ms), retention (ms), budget (bytes), the history streams' key prefix, the
--       resume counts' key prefix, then (request id, bytes) pairs
-- -> the number of streams dropped for the budget
local z, b = KEYS[1], KEYS[2]
local now, keep, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out, att = ARGV[4], ARGV[5]
local total = tonumber(redis.call('HGET', b, '_') or '0')
local function forget(rid)
  total = total - tonumber(redis.call('HGET', b, rid) or '0')
  redis.call('HDEL', b, rid)
  redis.call('ZREM', z, rid)
end
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', z, '-inf', now - keep, 'LIMIT', 0, 256)) do forget(rid) end
for i = 6, #ARGV, 2 do
  local rid, n = ARGV[i], tonumber(ARGV[i + 1])
  if redis.call('EXISTS', out .. rid) == 1 and not redis.call('ZSCORE', z, rid) then
    redis.call('ZADD', z, now, rid)
    redis.call('HSET', b, rid, n)
    total = total + n
  end
end
local dropped = 0
while total > budget do
  local oldest = redis.call('ZRANGE', z, 0, 0)
  if #oldest == 0 then break end
  forget(oldest[1])
  redis.call('DEL', out .. oldest[1], att .. oldest[1])
  dropped = dropped + 1
end
if redis.call('ZCARD', z) == 0 then
  redis.call('DEL', z, b)
else
  redis.call('HSET', b, '_', math.max(total, 0))
  redis.call('PEXPIRE', z, keep + 1000)
  redis.call('PEXPIRE', b, keep + 1000)
end
return dropped
