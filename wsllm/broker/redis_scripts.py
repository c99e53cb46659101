"""The broker's Lua scripts: each is a file of `lua/`, shipped as package data, and a
script that uses a library's functions is run as the library's text followed by its
own. Each file says what it does, its KEYS and ARGV, and what it returns; the Python
around them is `redis_queue.py` (the queue), `redis_limits.py` (the tenants' buckets),
`redis_engine.py` / `redis_gateway.py` (the registry, leases), `redis_retention.py`
and `redis_responses.py`. Every key a script touches is in one cluster slot: its KEYS."""

from __future__ import annotations

from importlib.resources import files


def lua(*names: str) -> str:
    """The text of the scripts `names` (in `lua/`), one after the other."""
    return "".join((files("wsllm.broker") / "lua" / f"{name}.lua").read_text() for name in names)


# The queue of one model (redis_queue.py): submit, the engines' take, the queue-deadline
# sweep, queue positions and a request's abort, over its waiting sets and counters.
SUBMIT = lua("queue_lib", "queue_submit")
TAKE = lua("queue_lib", "queue_take")
EXPIRE = lua("queue_lib", "queue_sets", "queue_expire")
POSITIONS = lua("queue_sets", "queue_positions")
ABORT = lua("queue_lib", "queue_abort")
REFUSE = lua("queue_lib", "queue_refuse")
# The engine registry and an engine's leases on the entries it holds.
ENGINES = lua("engines")
REFRESH = lua("lease_refresh")
# A model's published tokenizer, read only when it is within the gateway's cap.
TOKENIZER_READ = lua("tokenizer_read")
# A tenant's rate limits (limits.py has the rules; redis_limits.py calls these).
LIMIT_ACQUIRE = lua("bucket_lib", "limit_acquire")
LIMIT_RELEASE = lua("bucket_lib", "limit_release")
LIMIT_ADJUST = lua("bucket_lib", "limit_adjust")
LIMIT_USAGE = lua("bucket_lib", "limit_usage")
LIMIT_REFRESH = lua("limit_refresh")
# A tenant's stored Responses answers, within its budget; a delete leaves a tombstone
# (redis_responses.py).
RESPONSE_PUT = lua("response_put")
RESPONSE_DELETE = lua("response_delete")
# Finished requests' history streams: kept within their tenant's bytes, gone once their
# client took the whole answer (redis_retention.py).
STREAM_RETAIN = lua("stream_retain")
STREAM_RETIRE = lua("stream_retire")
