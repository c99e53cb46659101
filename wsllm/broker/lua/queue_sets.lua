-- The waiting sets of a model: the shared one and the routed ones. KEYS[1] is the queue.
local function sets(q)
  local out = {q .. ':z'}
  for _, e in ipairs(redis.call('SMEMBERS', q .. ':ze')) do out[#out + 1] = q .. ':z:' .. e end
  return out
end
