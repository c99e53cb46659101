-- Take `tokens` more from the tokens bucket (negative: give back, up to the capacity).
-- It may go below zero: a debt that the next requests wait out.
-- KEYS: tpm bucket   ARGV: tpm (> 0), tokens, window_ms   -> the level after
-- (run after bucket_lib.lua, whose functions it calls)
local tpm, tokens, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local k = math.min(tpm, level(KEYS[1], tpm, window) - tokens)
store(KEYS[1], k, tpm, window)
return tostring(k)
