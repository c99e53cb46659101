"""Redis clients for the broker: one Redis instance, or a Redis Cluster when the URL
says so.

    redis://host:6379/0                          one instance (also rediss://, unix://)
    redis+cluster://host:7000,host:7001,host:7002 a cluster: any reachable nodes of it,
    rediss+cluster://user:password@host:7000     the rest are discovered (TLS: rediss)
    rediss+cluster://h:7000?ssl_ca_certs=/ca.pem  with TLS options (CLUSTER_OPTIONS)

A cluster client (`redis.cluster.RedisCluster`, `redis.asyncio.cluster.RedisCluster`)
sends each command to the shard that holds its keys' slot; the key layout
(`redis_keys.py`) keeps what one command, script or MULTI touches in one slot. A
cluster has no databases: a `/db` in the URL is refused rather than ignored, and so is
a query option the cluster client would drop (redis-py's silently drops the ones it
does not know). No message names the URL with its credentials (`config_redis.redacted`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis

from wsllm.broker.redis_keys import client_options
from wsllm.config_redis import RedisConfig, redacted

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


#: the query options a cluster URL may carry (both redis-py cluster clients take them),
#: each with its parser; TLS ones need rediss+cluster://
CLUSTER_OPTIONS: dict[str, Callable[[str], Any]] = {
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": lambda v: _choice(v, ("none", "optional", "required")),
    "ssl_check_hostname": lambda v: _choice(v.lower(), ("true", "false", "1", "0")) in ("true", "1"),
    "client_name": str,
}


def _choice(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"one of {', '.join(allowed)}, got {value!r}")
    return value


def _query_options(scheme: str, query: str) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        parse = CLUSTER_OPTIONS.get(name)
        if parse is None:
            raise ValueError(
                f"a Redis Cluster URL takes the options {', '.join(CLUSTER_OPTIONS)}; {name!r} is not one"
            )
        if name.startswith("ssl_") and not scheme.startswith("rediss"):
            raise ValueError(f"the option {name} needs TLS: a rediss+cluster:// URL")
        try:
            opts[name] = parse(value)
        except ValueError as e:
            raise ValueError(f"the Redis Cluster URL option {name}: {e}") from None
    return opts


def cluster_settings(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The startup nodes of a `redis+cluster://` URL and the client settings it names
    (username, password, ssl and the CLUSTER_OPTIONS of its query). ValueError, never
    naming the credentials, for what it cannot serve."""
    scheme, rest = url.split("://", 1)
    userinfo, _, where = rest.rpartition("@")
    where, _, query = where.partition("?")
    hosts, _, path = where.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, the URL names {path!r}")
    nodes = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a cluster node must be host:port, got {part!r} in {redacted(url)!r}")
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
    return nodes, opts | _query_options(scheme, query)


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
