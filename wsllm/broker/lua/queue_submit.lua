-- Admission and submit in one step: refuse past the depth (waiting + hand-backs) or the
-- tenant's share, else give the request its place (see the module doc), open its
-- history stream with the meta entry (`q`/`qe`: the set it waits in and its header,
-- so an abort finds it there, or, once taken, in the request stream `rq` through
-- `{queue}:tk`; `s` the gateway's results stream), and wake the engines. The gateway
-- reads its results stream all the time: it needs no wake-up.
-- KEYS: queue, out   ARGV: depth, tenant cap, request, meta, ttl_ms, request id,
--                          deadline, priority, tenant, target engine ('' none), results
--   -> {1, waiting set, header} or {0, count, 'depth' | 'tenant'}
-- (run after queue_lib.lua, whose functions it calls)
local q, out = KEYS[1], KEYS[2]
local cnt = q .. ':n'
local prio, tenant, eng = tonumber(ARGV[8]), ARGV[9], ARGV[10]
local pt = prio .. ':' .. tenant
local got = redis.call('HMGET', cnt, 'n', 'h', 't:' .. tenant, 'k:' .. pt, 'v:' .. pt, 'c:' .. prio,
  'l:' .. prio, 's', 'rt', 'e:' .. eng, 'w')
local v = {}
for i = 1, 11 do v[i] = tonumber(got[i]) or 0 end
local n, h, mine, k, last, clock, l, s, rt, e, woken = unpack(v)
if n + h >= tonumber(ARGV[1]) then return {0, n + h, 'depth'} end
if mine >= tonumber(ARGV[2]) then return {0, mine, 'tenant'} end
local tag = clock
if k > 0 then tag = last + 1 end
local set = q .. ':z'
if eng ~= '' then set = set .. ':' .. eng end
local deadline = math.min(math.max(tonumber(ARGV[7]) or 0, 0), 1e12)
local hdr = string.format('%07d%015d%012d%020.6f', 1000000 - prio, tag, s + 1, deadline)
local id = redis.call('XADD', out, '*', 'm', ARGV[4], 'q', set, 'qe', hdr, 's', ARGV[11], 'rq', q)
redis.call('PEXPIRE', out, ARGV[5])
local at = tonumber(string.match(id, '^(%d+)'))
redis.call('ZADD', set, 0, hdr .. cmsgpack.pack(ARGV[6], ARGV[11], tenant, eng, at, ARGV[3]))
local upd = {'n', n + 1, 't:' .. tenant, mine + 1, 'k:' .. pt, k + 1, 'v:' .. pt, tag, 'l:' .. prio, l + 1,
  's', s + 1}
if eng ~= '' then
  upd[#upd + 1] = 'rt'; upd[#upd + 1] = rt + 1; upd[#upd + 1] = 'e:' .. eng; upd[#upd + 1] = e + 1
  if e == 0 then redis.call('SADD', q .. ':ze', eng) end
end
if woken == 0 then  -- no wake-up since the last take: send one (every take clears `w`)
  upd[#upd + 1] = 'w'; upd[#upd + 1] = 1
  redis.call('XADD', q .. ':nt', 'MAXLEN', '1', '*', 'x', '1')
end
redis.call('HSET', cnt, unpack(upd))
return {1, set, hdr}
