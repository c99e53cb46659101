-- Best-effort places of waiting requests: 1 + the members ahead of it (in queue order)
-- in every waiting set; 0 once taken (or gone).
-- KEYS: queue   ARGV: (waiting set, header) pairs   -> places
-- (run after queue_sets.lua, whose functions it calls)
local q = KEYS[1]
local all = sets(q)
local out = {}
for i = 1, #ARGV, 2 do
  local set, hdr = ARGV[i], ARGV[i + 1]
  if redis.call('ZLEXCOUNT', set, '[' .. hdr, '(' .. hdr .. '\255') == 0 then
    out[#out + 1] = 0
  else
    local ahead = 0
    for _, s in ipairs(all) do ahead = ahead + redis.call('ZLEXCOUNT', s, '-', '(' .. hdr) end
    out[#out + 1] = ahead + 1
  end
end
return out
