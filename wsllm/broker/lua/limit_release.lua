-- A request ended: drop its lease, give `refund` tokens back (up to the capacity).
-- KEYS: tpm bucket, live set   ARGV: tpm, refund, request_id, window_ms
-- (run after bucket_lib.lua, whose functions it calls)
redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, refund, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if tpm > 0 and refund > 0 then store(KEYS[1], math.min(tpm, level(KEYS[1], tpm, window) + refund), tpm, window) end
return 1
