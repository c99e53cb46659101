-- Helpers of every queue script. `forget` updates the counters for members that left
-- the waiting sets (taken, aborted, expired); each is {priority, tenant, engine, tag}
-- (tag: the virtual time of a taken one, which moves its level's clock on; nil else).
local H = 54
local function hprio(m) return 1000000 - tonumber(string.sub(m, 1, 7)) end
local function htag(m) return tonumber(string.sub(m, 8, 22)) end
local function hdeadline(m) return tonumber(string.sub(m, 35, 54)) end
-- request id, results stream, tenant, engine, submit time (ms), request
local function body(m) return cmsgpack.unpack(string.sub(m, H + 1)) end
local function forget(q, gone, known)
  if #gone == 0 then return end
  local cnt = q .. ':n'
  if known then  -- {n, rt, h} as read in this script: when nothing is left, skip the read
    local routed = 0
    for _, g in ipairs(gone) do if g[3] ~= '' then routed = routed + 1 end end
    if known[1] - #gone <= 0 and known[2] - routed <= 0 and known[3] <= 0 then
      redis.call('DEL', cnt, q .. ':ze')
      return
    end
  end
  local names, at = {'n', 'rt', 'h'}, {n = 1, rt = 2, h = 3}
  local function want(f) if not at[f] then names[#names + 1] = f; at[f] = #names end end
  for _, g in ipairs(gone) do
    want('t:' .. g[2]); want('k:' .. g[1] .. ':' .. g[2]); want('l:' .. g[1]); want('c:' .. g[1])
    if g[3] ~= '' then want('e:' .. g[3]) end
  end
  local got = redis.call('HMGET', cnt, unpack(names))
  local v = {}
  for i, f in ipairs(names) do v[f] = tonumber(got[i]) or 0 end
  for _, g in ipairs(gone) do
    local p, t, e = g[1], g[2], g[3]
    v.n = v.n - 1
    v['t:' .. t] = v['t:' .. t] - 1
    v['k:' .. p .. ':' .. t] = v['k:' .. p .. ':' .. t] - 1
    v['l:' .. p] = v['l:' .. p] - 1
    if g[4] and g[4] > v['c:' .. p] then v['c:' .. p] = g[4] end
    if e ~= '' then v.rt = v.rt - 1; v['e:' .. e] = v['e:' .. e] - 1 end
  end
  local set, del, idle = {}, {}, {}
  for _, f in ipairs(names) do
    local kind, rest = string.match(f, '^(%a+):?(.*)$')
    local x = v[f]
    if kind == 'c' then x = (v['l:' .. rest] > 0) and x or 0 end  -- an empty level's clock goes
    if x > 0 or (kind == 'c' and v['l:' .. rest] > 0) then
      set[#set + 1] = f; set[#set + 1] = x
    else
      del[#del + 1] = f
      if kind == 'k' then del[#del + 1] = 'v:' .. rest end  -- the tenant left the level
      if kind == 'e' then idle[#idle + 1] = rest end
    end
  end
  if v.n <= 0 and v.h <= 0 and v.rt <= 0 then  -- nothing waits: the counters go
    redis.call('DEL', cnt, q .. ':ze')
    return
  end
  del[#del + 1] = 'w'  -- engines took (or the queue changed) since the last wake-up
  if #set > 0 then redis.call('HSET', cnt, unpack(set)) end
  redis.call('HDEL', cnt, unpack(del))
  if #idle > 0 then redis.call('SREM', q .. ':ze', unpack(idle)) end
end
