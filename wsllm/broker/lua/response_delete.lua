-- KEYS: the response's hash   ARGV: tenant. 1 when it was the tenant's and is gone.
if redis.call('HGET', KEYS[1], 'tenant') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
