-- Store a response within its tenant's budget: its own oldest records go first.
-- KEYS: the record's hash, the tenant's index (sorted set: id -> expiry ms), the tenant's
-- sizes (hash: id -> bytes)   ARGV: id, record, ttl_ms, max_bytes, max_records, the key
-- prefix of the tenant's records (+ id: a record's hash; the same slot, by its hash tag)
-- -> 1 kept, 0 not: a tombstone (the response was deleted: a late run does not revive it)
if redis.call('HEXISTS', KEYS[1], 'tomb') == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, record, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local max_bytes, max_records = tonumber(ARGV[4]), tonumber(ARGV[5])
-- the expired leave the index first (their hashes expired by themselves)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[3], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'record', record)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now + ttl, id)
redis.call('HSET', KEYS[3], id, #record)
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(v) end
local count = redis.call('ZCARD', KEYS[2])
while (total > max_bytes or count > max_records) and count > 1 do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if oldest == id then break end
  total = total - tonumber(redis.call('HGET', KEYS[3], oldest) or '0')
  count = count - 1
  redis.call('ZREM', KEYS[2], oldest)
  redis.call('HDEL', KEYS[3], oldest)
  redis.call('DEL', ARGV[6] .. oldest)
end
-- the index lives as long as its newest record
for i = 2, 3 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return 1
