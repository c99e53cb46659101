-- Rate limits (wsllm/broker/limits.py has the rules). Time is Redis's own (TIME), so
-- gateways with skewed clocks still agree. A bucket is a hash {l: level, t: ms}; a missing
-- one is full, and each expires once it would be full again (a second later): a bucket in
-- debt (below zero) lives until the debt is repaid. Limits of 0 mean none.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, cap, window)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / window)
end
local function store(key, l, cap, window)
  redis.call('HSET', key, 'l', tostring(l), 't', now)
  redis.call('PEXPIRE', key, math.ceil((cap - l) * window / cap) + 1000)
end
