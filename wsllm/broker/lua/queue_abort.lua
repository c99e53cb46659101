-- Abort from any gateway, the request's part (its model's slot): drop the request where
-- it waits (its meta entry names the set and the header), or in the request stream once
-- taken (so that a request whose engine is gone leaves nothing behind), and end the
-- history stream and its gateway's results stream with a whole-request abort marker (a
-- resumed client sees the end). A grace abort passes ARGV[4], the attach count its
-- client had: it does nothing when a client resumed the request since (the count moved
-- on). Then it tells the model's engines (its abort stream).
-- KEYS: out, attached, aborts   ARGV: rid, retention_ms, marker, attach ('' = always),
--                               results ttl_ms, aborts maxlen
-- (run after queue_lib.lua, whose functions it calls)
if ARGV[4] ~= '' and (redis.call('GET', KEYS[2]) or '0') ~= ARGV[4] then return 0 end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if #first == 0 then return -1 end
local f = first[1][2]
local set, hdr, s, rq
for i = 1, #f, 2 do
  if f[i] == 'q' then set = f[i + 1] elseif f[i] == 'qe' then hdr = f[i + 1] elseif f[i] == 's' then s = f[i + 1]
  elseif f[i] == 'rq' then rq = f[i + 1] end
end
if set and hdr and rq then
  local m = redis.call('ZRANGEBYLEX', set, '[' .. hdr, '(' .. hdr .. '\255', 'LIMIT', 0, 1)[1]
  if m then
    redis.call('ZREM', set, m)
    local _, _, tenant, eng = body(m)
    forget(rq, {{hprio(m), tenant, eng}})
  else
    -- taken: the take moved it into the request stream `rq` under a new id (TAKE)
    local te = redis.call('HGET', rq .. ':tk', ARGV[1])
    if te then
      redis.call('XDEL', rq, te)
      redis.call('HDEL', rq .. ':tk', ARGV[1])
    end
  end
end
redis.call('XADD', KEYS[1], '*', 'e', ARGV[3])
if s then
  redis.call('XADD', s, '*', 'e', ARGV[3])
  if redis.call('PTTL', s) == -1 then redis.call('PEXPIRE', s, ARGV[5]) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])  -- its resume count, kept as long as its history
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'r', ARGV[1])
return 1
