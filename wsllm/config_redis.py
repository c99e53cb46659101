"""The Redis Streams broker's settings (`RedisConfig`): a module of its own, as each
component's settings are; its flags and `WSLLM_*` variables are derived by
`wsllm.config.add_arguments` / `from_args` like every other component's."""

from __future__ import annotations

from dataclasses import dataclass, field

#: what a gateway's results stream keeps beyond what its requests' histories lack (seconds)
RESULTS_SLACK_S = 10.0


@dataclass(slots=True)
class RedisConfig:
    """Where requests travel (`broker`), and the Redis Streams broker's settings,
    shared by `wsllm serve`, `wsllm gateway` and `wsllm engine`. Times are seconds.
    The key layout is in docs/architecture.md (the broker section)."""

    broker: str = field(
        default="memory",
        metadata={
            "help": "memory (serve: all in this process) | redis://host:port/db, rediss://, unix://, "
            "redis+cluster://host:port[,host:port...] (a Redis Cluster)",
            "aliases": ("--redis-url",),
            "env_aliases": ("WSLLM_REDIS_URL",),
        },
    )
    redis_prefix: str = field(default="wsllm", metadata={"help": "prefix of every key this deployment uses"})
    engine_id: str | None = field(
        default=None,
        metadata={
            "help": "this engine's consumer name; a stable one picks up its own pending work after a restart"
        },
    )
    lease_s: float = field(
        default=20.0, metadata={"help": "a request whose engine stopped heartbeating this long is reclaimed"}
    )
    engine_ttl_s: float = field(
        default=10.0, metadata={"help": "an engine not heard from this long is not counted as live"}
    )
    engine_heartbeat_s: float = field(
        default=0.5, metadata={"help": "engine heartbeat (registry, lease refresh) interval"}
    )
    max_deliveries: int = field(
        default=3, metadata={"help": "deliveries before a request goes to the dead-letter stream"}
    )
    stream_retention_s: float = field(
        default=300.0,
        metadata={
            "help": "how long a finished request's events stay resumable, unless its client took its whole "
            "answer (then they go at once)"
        },
    )
    stream_retention_tenant_bytes: int = field(
        default=32 << 20,
        metadata={
            "help": "bytes of finished requests' events one tenant keeps resumable per model: past it its own "
            "oldest go (docs/deployment.md, Redis memory)"
        },
    )
    request_ttl_s: float = field(
        default=3600.0,
        metadata={"help": "upper bound on a live request's keys (they shrink to the retention when it ends)"},
    )
    resume_grace_s: float = field(
        default=30.0,
        metadata={"help": "a request whose client left runs this long for a resume, then is aborted"},
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM, an engine finishes its requests for this long, then hands the rest back"
        },
    )
    queue_poll_s: float = field(
        default=0.5, metadata={"help": "how often waiting WS requests get a `queued` position"}
    )
    history_flush_s: float = field(
        default=10.0,
        metadata={
            "help": "a running request's events are copied to its own (resumable) stream this often; "
            "each step's events reach its gateway at once through the gateway's results stream"
        },
    )
    aborts_maxlen: int = field(default=10000, metadata={"help": "length of each model's abort stream"})
    dead_letter_maxlen: int = field(default=10000, metadata={"help": "length of each dead-letter stream"})
    redis_socket_timeout_s: float = field(
        default=5.0,
        metadata={
            "help": "a Redis command with no answer for this long fails (503 to clients, retried by the loops); "
            "blocking reads add their own wait to it"
        },
    )
    redis_connect_timeout_s: float = field(
        default=2.0, metadata={"help": "a connection to Redis not made within this long fails"}
    )
    routing: str = field(
        default="prefix",
        metadata={
            "help": "how a gateway picks the engine for a request: prefix (the engine holding the longest "
            "cached prefix of its prompt, docs/routing.md) or fifo (whichever engine pulls first)",
            "choices": lambda: ["prefix", "fifo"],
        },
    )
    steal_after_s: float = field(
        default=0.05,
        metadata={
            "help": "a request routed to an engine may be taken by another once it waited this long and its "
            "engine is busy (docs/routing.md)"
        },
    )
    limit_lease_s: float = field(
        default=30.0,
        metadata={
            "help": "a tenant's in-flight request counts against max_concurrent this long after its gateway stops refreshing it (a crash)"
        },
    )

    def __post_init__(self) -> None:
        if self.engine_heartbeat_s <= 0 or self.lease_s < 2 * self.engine_heartbeat_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) must be at least twice engine_heartbeat_s ({self.engine_heartbeat_s})"
            )
        if self.max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {self.max_deliveries}")
        if self.stream_retention_tenant_bytes < 1:
            raise ValueError(
                f"stream_retention_tenant_bytes must be >= 1, got {self.stream_retention_tenant_bytes}"
            )
        if min(self.stream_retention_s, self.request_ttl_s, self.engine_ttl_s) <= 0:
            raise ValueError("stream_retention_s, request_ttl_s and engine_ttl_s must be > 0")
        if self.history_flush_s <= 0:
            raise ValueError(f"history_flush_s must be > 0, got {self.history_flush_s}")
        if self.request_ttl_s < self.stream_retention_s:
            raise ValueError("request_ttl_s must be >= stream_retention_s")
        if self.broker != "memory" and not self.uses_redis:
            raise ValueError(
                f"broker must be memory or a redis://, rediss://, unix:// or redis+cluster:// URL, got {redacted(self.broker)!r}"
            )
        if not (0 < self.redis_socket_timeout_s <= 600 and 0 < self.redis_connect_timeout_s <= 600):
            raise ValueError("redis_socket_timeout_s and redis_connect_timeout_s must be in (0, 600] seconds")
        if self.limit_lease_s < 3:
            raise ValueError(f"limit_lease_s must be >= 3, got {self.limit_lease_s}")
        if self.routing not in ("prefix", "fifo"):
            raise ValueError(f"routing must be prefix or fifo, got {self.routing!r}")
        if not 0 <= self.steal_after_s <= 60:
            raise ValueError(f"steal_after_s must be in [0, 60] seconds, got {self.steal_after_s}")

    @property
    def results_tail_s(self) -> float:
        """How long a gateway's results stream keeps an entry: what a running request's
        history has not copied yet (at most `history_flush_s` old; an ended request's last
        events are copied when it ends) and a slack of `RESULTS_SLACK_S` for a reader
        that fell behind (the retention, if shorter). Not the retention: a results
        stream holds every request's every event, so its tail is most of Redis's memory
        (docs/deployment.md)."""
        return min(self.stream_retention_s, RESULTS_SLACK_S) + 2 * self.history_flush_s

    @property
    def results_ttl_ms(self) -> int:
        """The TTL its writers give a results stream every `results_tail_s / 4`: its last
        entry lives the tail, and the stream of a gateway gone goes soon after."""
        return int(self.results_tail_s * 1250)

    @property
    def uses_redis(self) -> bool:
        return self.broker.startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
        )

    def url(self) -> str:
        """The Redis URL: --broker when it names Redis, else localhost (for `gateway`
        and `engine`, which always use Redis)."""
        return self.broker if self.uses_redis else "redis://localhost:6379/0"


_SECRET_QUERY = ("password", "ssl_password")  # query options whose values are secrets


def redacted(url: str) -> str:
    """`url` as it may be printed or logged: its credentials (`user:password@`) and any
    password among its query options replaced by `***`."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    where, q, query = rest.partition("?")
    userinfo, at, hosts = where.rpartition("@")
    shown = f"{head}{sep}{'***@' if at else ''}{hosts}"
    if q:
        parts = [p.partition("=") for p in query.split("&")]
        shown += "?" + "&".join(f"{k}{eq}{'***' if k in _SECRET_QUERY and eq else v}" for k, eq, v in parts)
    return shown
