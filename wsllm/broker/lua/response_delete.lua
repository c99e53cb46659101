-- Delete a tenant's response, leaving a tombstone that `response_put.lua` never passes
-- (a background run still going cannot store it again).
-- KEYS: the record's hash, the tenant's index, the tenant's sizes   ARGV: id, tombstone ms
-- -> 1 when the tenant had it (its keys hold only its records: another tenant's key names
-- another hash), 0 otherwise
if redis.call('HEXISTS', KEYS[1], 'record') == 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'tomb', '1')
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
