"""Redis clients for the broker: one Redis instance, or a Redis Cluster when the URL
says so.

    redis://host:6379/0                          one instance (also rediss://, unix://)
    redis+cluster://host:7000,host:7001,host:7002 a cluster: any reachable nodes of it,
    rediss+cluster://user:password@host:7000     the rest are discovered (TLS: rediss)

A cluster client (`redis.cluster.RedisCluster`, `redis.asyncio.cluster.RedisCluster`)
sends each command to the shard that holds its keys' slot; the key layout
(`redis_keys.py`) keeps what one command, script or MULTI touches in one slot. A
cluster has no databases: a `/db` in the URL is refused rather than ignored.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Any
from urllib.parse import unquote

import redis

from wsllm.broker.redis_keys import client_options
from wsllm.config_redis import RedisConfig

log = logging.getLogger(__name__)

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_SHAS: dict[str, str] = {}  # script text -> its SHA1, as Redis names it


async def eval_script(client: Any, script: str, keys: list[Any], args: list[Any]) -> Any:
    """Run `script` by its SHA1 (EVALSHA), and by its text only when the node does not
    know it yet (NOSCRIPT; EVAL caches it there): the gateway's scripts are a few KB, and
    their text in every submit was Redis's largest cost per call after the take."""
    sha = _SHAS.get(script)
    if sha is None:
        sha = _SHAS[script] = hashlib.sha1(script.encode()).hexdigest()
    try:
        return await client.evalsha(sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return await client.eval(script, len(keys), *keys, *args)


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def cluster_settings(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The startup nodes of a `redis+cluster://` URL and the client settings it names
    (username, password, ssl)."""
    scheme, rest = url.split("://", 1)
    userinfo, _, where = rest.rpartition("@")
    hosts, _, path = where.split("?", 1)[0].partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, the URL names {path!r}")
    nodes = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a cluster node must be host:port, got {part!r} in {url!r}")
        nodes.append((host.strip("[]"), int(port)))
    opts: dict[str, Any] = {}
    if userinfo:
        user, sep, password = userinfo.partition(":")
        if sep:
            opts["password"] = unquote(password)
            if user:
                opts["username"] = unquote(user)
        else:
            opts["password"] = unquote(user)
    if scheme.startswith("rediss"):
        opts["ssl"] = True
    return nodes, opts


def stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of an XREAD / XREADGROUP (the first half of what follows STREAMS); None
    for any other command, or one this does not parse."""
    name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
    if name.upper() not in ("XREAD", "XREADGROUP"):
        return None
    skip = {"COUNT": 2, "BLOCK": 2, "GROUP": 3, "NOACK": 1, "CLAIM": 2}
    i = 1
    while i < len(args):
        word = args[i].decode() if isinstance(args[i], bytes) else str(args[i])
        if word.upper() == "STREAMS":
            rest = args[i + 1 :]
            return list(rest[: len(rest) // 2]) if rest and len(rest) % 2 == 0 else None
        if word.upper() not in skip:
            return None
        i += skip[word.upper()]
    return None


def _local_stream_keys(client: Any) -> Any:
    """Teach a cluster client the keys of XREAD and XREADGROUP: redis-py asks a node
    (`COMMAND GETKEYS`, always the same one) for those of every command whose keys
    move, a third of the cluster's commands per token in bench/broker_scale.py, all on
    one shard. The parser is swapped for a subclass in place (it keeps what it read)."""
    parser = client.commands_parser
    if getattr(client, "_wsllm_local_keys", False):
        return client
    base = type(parser)
    if inspect.iscoroutinefunction(base.get_keys):

        class _AsyncParser(base):  # type: ignore[misc, valid-type]
            async def get_keys(self, *args: Any) -> Any:
                keys = stream_read_keys(args)
                return tuple(keys) if keys is not None else await super().get_keys(*args)

        parser.__class__ = _AsyncParser
    else:

        class _Parser(base):  # type: ignore[misc, valid-type]
            def get_keys(self, redis_conn: Any, *args: Any) -> Any:
                keys = stream_read_keys(args)
                return keys if keys is not None else super().get_keys(redis_conn, *args)

        parser.__class__ = _Parser
    client._wsllm_local_keys = True
    return client


def sync_client(url: str, cfg: RedisConfig, wait_s: float = 0.0) -> Any:
    """A blocking client (the engine side, tools)."""
    opts = client_options(cfg, wait_s=wait_s)
    if not is_cluster(url):
        return redis.Redis.from_url(url, **opts)
    from redis.cluster import ClusterNode, RedisCluster

    nodes, extra = cluster_settings(url)
    return _local_stream_keys(
        RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **opts, **extra)
    )


def async_client(url: str, cfg: RedisConfig, wait_s: float = 0.0, single_connection: bool = False) -> Any:
    """An asyncio client (the gateway side). `single_connection`: a reader that blocks
    on its own connection (one instance only: a cluster client keeps a pool per node)."""
    opts = client_options(cfg, asyncio=True, wait_s=wait_s)
    if not is_cluster(url):
        import redis.asyncio

        return redis.asyncio.Redis.from_url(url, single_connection_client=single_connection, **opts)
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    nodes, extra = cluster_settings(url)
    return _local_stream_keys(
        RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **opts, **extra)
    )


async def reader_client(url: str, cfg: RedisConfig, key: str, wait_s: float) -> Any:
    """A client for one blocking reader: one connection of its own. On a cluster, a plain
    client of the node that holds `key`'s slot (all the keys one read names share it):
    a blocking read needs no routing, and the cluster client can swallow the cancel of
    a blocked read. A read that meets MOVED (a failover, a resharding) asks again."""
    if not is_cluster(url):
        return async_client(url, cfg, wait_s=wait_s, single_connection=True)
    import redis.asyncio

    c = async_client(url, cfg)
    try:
        await c.initialize()
        node = c.get_node_from_key(key)
        host, port = node.host, node.port
    finally:
        await c.aclose()
    _, extra = cluster_settings(url)
    opts = client_options(cfg, asyncio=True, wait_s=wait_s)
    return redis.asyncio.Redis(host=host, port=port, single_connection_client=True, **opts, **extra)
