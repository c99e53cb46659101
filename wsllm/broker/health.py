"""`python -m wsllm.broker.health`: exit 0 when this host's engine is registered in
Redis and alive (its heartbeat key has not expired), 1 otherwise. A container
healthcheck: it reads the same WSLLM_* settings as `wsllm engine`.

With `WSLLM_ENGINE_ID` set, it checks that engine; otherwise any engine whose id
starts with this host's name (`wsllm engine` names itself `<hostname>-<pid>`).

`engine_alive` and `forget_engine` are the same reads and writes for a tool: `wsllm
serve --broker redis://`'s supervisor waits for its child's heartbeat with the one and
removes a dead child's registration with the other.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import redis

from wsllm.broker.redis_conn import sync_client
from wsllm.broker.redis_keys import Keys
from wsllm.config import from_args
from wsllm.config_redis import RedisConfig


def engine_alive(url: str, rcfg: RedisConfig, engine_id: str, client: Any = None) -> bool:
    """Whether `engine_id`'s heartbeat is in Redis now (blocking; for tools). `client`: a
    blocking client of the caller's to use (one who asks often keeps one: a connection
    each time costs Redis a client's buffers each time)."""
    r = client if client is not None else sync_client(url, rcfg)
    try:
        return bool(r.exists(Keys(rcfg.redis_prefix).engine(engine_id)))
    finally:
        if client is None:
            r.close()


def forget_engine(url: str, rcfg: RedisConfig, engine_id: str, client: Any = None) -> None:
    """Remove `engine_id` from the registry (as the engine's own deregister does): an
    engine process that died, so that gateways stop counting it before its TTL."""
    keys = Keys(rcfg.redis_prefix)
    r = client if client is not None else sync_client(url, rcfg)
    try:
        pipe = r.pipeline(transaction=False)
        pipe.delete(keys.engine(engine_id))
        pipe.srem(keys.engines, engine_id)
        pipe.execute()
    finally:
        if client is None:
            r.close()


def main() -> int:
    rcfg = from_args(RedisConfig)
    keys = Keys(rcfg.redis_prefix)
    r = sync_client(rcfg.url(), rcfg)
    try:
        if rcfg.engine_id:
            alive = bool(r.exists(keys.engine(rcfg.engine_id)))
        else:
            host = socket.gethostname() + "-"
            ids = [m.decode() for m in r.smembers(keys.engines)]  # type: ignore[union-attr]
            alive = any(r.exists(keys.engine(i)) for i in ids if i.startswith(host))
    except redis.exceptions.RedisError as e:
        print(f"unhealthy: redis: {e}", file=sys.stderr)
        return 1
    if not alive:
        print("unhealthy: no live engine of this host is registered", file=sys.stderr)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
