-- A request whose client took its whole answer: its history stream and its resume count
-- go at once, and its record leaves its tenant's kept set (stream_retain.lua).
-- KEYS: its history stream, its resume count, the tenant's kept set, its bytes hash
-- ARGV: the request id
-- -> 1 when its stream was there
local gone = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
local n = redis.call('HGET', KEYS[4], ARGV[1])
if n then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  local total = tonumber(redis.call('HGET', KEYS[4], '_') or '0') - tonumber(n)
  redis.call('HSET', KEYS[4], '_', math.max(total, 0))
end
return gone
