-- A model's published tokenizer files, unless they are larger than the cap: a gateway
-- must not read (and hold) whatever an engine, or anyone with the Redis password, wrote.
-- KEYS: the tokenizer hash   ARGV: the cap in bytes
-- -> {0, bytes} when over it, else {1, name, data, name, data, ...}
local total = 0
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  total = total + redis.call('HSTRLEN', KEYS[1], name)
end
if total > tonumber(ARGV[1]) then return {0, total} end
local out = {1}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do out[#out + 1] = v end
return out
