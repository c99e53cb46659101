-- Check and take, all or nothing: one request, `charge` tokens, a lease on `request_id`.
-- KEYS: rpm bucket, tpm bucket, live set   ARGV: rpm, tpm, max_concurrent, charge,
-- request_id, lease_ms, window_ms   -> {refused reason or '', wait_ms, rpm level, tpm level}
-- (run after bucket_lib.lua, whose functions it calls)
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local charge, lease, window = tonumber(ARGV[4]), tonumber(ARGV[6]), tonumber(ARGV[7])
local r, k = level(KEYS[1], rpm, window), level(KEYS[2], tpm, window)
local reason, wait = '', 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  -- a request that holds its lease already (its client resumes it) does not count twice
  local held = redis.call('ZSCORE', KEYS[3], ARGV[5])
  if not held and redis.call('ZCARD', KEYS[3]) >= conc then reason, wait = 'concurrent', 1000 end
end
if reason == '' and rpm > 0 and r < 1 then
  reason, wait = 'requests', (1 - r) * window / rpm
elseif reason == '' and tpm > 0 and k < charge then
  reason, wait = 'tokens', (charge - k) * window / tpm
end
if reason == '' then
  if rpm > 0 then r = r - 1; store(KEYS[1], r, rpm, window) end
  if tpm > 0 then k = k - charge; store(KEYS[2], k, tpm, window) end
  if conc > 0 then
    redis.call('ZADD', KEYS[3], now + lease, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], lease)
  end
end
return {reason, tostring(wait), tostring(r), tostring(k)}
