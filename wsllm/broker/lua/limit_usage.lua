-- A tenant's buckets and live leases, read only.
-- KEYS: rpm bucket, tpm bucket, live set   ARGV: rpm, tpm, window_ms -> {rpm level, tpm level, leases}
-- (run after bucket_lib.lua, whose functions it calls)
local window = tonumber(ARGV[3])
local r, k = level(KEYS[1], tonumber(ARGV[1]), window), level(KEYS[2], tonumber(ARGV[2]), window)
return {tostring(r), tostring(k), redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')}
