-- Lease refresh: reset the idle time of the entries this engine still owns (so that
-- XAUTOCLAIM leaves them alone), and report those it does not own any more. One XPENDING
-- of this consumer's entries and one XCLAIM per 1000 of them, whatever their number.
-- KEYS: queue   ARGV: group, consumer, scan limit, entry ids...   -> ids no longer ours
local mine = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', ARGV[3], ARGV[2])) do
  mine[p[1]] = true
end
local lost, keep = {}, {}
for i = 4, #ARGV do
  if mine[ARGV[i]] then keep[#keep + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
for i = 1, #keep, 1000 do
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #keep) do args[#args + 1] = keep[j] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return lost
