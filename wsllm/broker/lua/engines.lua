-- Live engines: the ids whose heartbeat key still exists, with its payload and the
-- milliseconds it has left; ids whose key expired leave the set.
-- KEYS: engines set   ARGV: engine key prefix
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
