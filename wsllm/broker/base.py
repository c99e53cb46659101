"""The broker contract: how requests reach engines and TokenEvents come back.

Two contracts, one per side:

- `GatewayBroker`, the gateway's side (asyncio): `submit`, `abort`, iterate `events()`;
  `engines()` tells whether anything can serve it (`/ready`, gauges, limits);
- `EngineBroker`, the engine's side (a plain thread or process, no asyncio): `pull`,
  `aborts`, `publish` and `heartbeat`.

A gateway-side call never blocks the event loop for long; an engine-side call may
block, always with a timeout, so that the worker can notice it was asked to stop.
The memory broker and the Redis broker implement both (`Broker`) and pass the same
tests (tests/unit/test_broker_contract.py). The engine worker does not import this
module: it declares the engine side it uses as a Protocol (wsllm/engine/worker.py),
which every `EngineBroker` satisfies.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wsllm.broker.limits import Limiter, MemoryLimiter
from wsllm.broker.response_store import MemoryResponseStore, ResponseStore
from wsllm.types import AdapterCommand, AdapterReply, EngineInfo, GenerateRequest, TokenEvent

#: the files of a model directory that make its tokenizer (what `TextCodec` reads)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    # a model that sees: how its images become placeholder tokens (image_tiles.py)
    "preprocessor_config.json",
    "processor_config.json",
)
#: the largest tokenizer an engine publishes through the broker (bytes, all files)
MAX_TOKENIZER_BYTES = 64 << 20


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The tokenizer files of a model directory, for `Broker.publish_tokenizer`;
    ValueError past MAX_TOKENIZER_BYTES."""
    paths = [Path(directory) / name for name in TOKENIZER_FILES]
    files = {p.name: p.read_bytes() for p in paths if p.is_file()}
    size = sum(map(len, files.values()))
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"the tokenizer in {directory} is {size} bytes, over {MAX_TOKENIZER_BYTES}")
    return files


#: how many times a request held by a stalled engine is handed on to another (`release`)
STALL_HANDOFFS = 1

#: an engine's admission order for queued requests: lower goes first
Rank = Callable[[GenerateRequest], Any]

log = logging.getLogger(__name__)


class BrokerError(Exception):
    """Base class of the errors a broker raises to the gateway."""


class QueueFull(BrokerError):
    """Too many requests wait for an engine; the gateway answers 429 with Retry-After."""


class BrokerClosed(BrokerError):
    """The broker was closed; nothing more goes through it."""


class BrokerUnavailable(BrokerError):
    """The broker's backing store (Redis) cannot be reached now; the gateway answers
    503 with Retry-After, and things resume by themselves when it is back."""


@dataclass(slots=True)
class Resumable:
    """What a gateway needs to pick up a request that another connection (or another
    gateway process) started: stored with the request by `submit(..., context=)`.
    The context holds the hash of the request's resume token: the gateway checks it."""

    request_id: str
    context: dict[str, Any]


class GatewayBroker(abc.ABC):
    """The gateway's side of a broker; call it from the asyncio loop."""

    #: an engine whose last heartbeat is older than this is not counted as alive
    engine_ttl_s: float = 10.0
    #: True when a request outlives its client's connection: its events stay readable
    #: (`lookup`, `follow`) for a retention time, from any gateway of the deployment.
    resumable: bool = False
    #: how long a request whose client left keeps running, waiting for a resume
    resume_grace_s: float = 0.0
    #: how often a gateway tells a waiting WebSocket request its `position`
    queue_poll_s: float = 0.5

    @abc.abstractmethod
    async def submit(
        self,
        request: GenerateRequest,
        *,
        context: dict[str, Any] | None = None,
    ) -> None:
        """Queue `request` for an engine; this gateway receives its events. Raises
        QueueFull when the broker's `max_queue_depth` requests already wait, or the
        request's tenant has its share of them (`max_queue_share`, fair_queue.py),
        BrokerClosed after close(), BrokerUnavailable while the store is down.
        Never waits for an engine to take it. A resumable broker keeps `context`
        (JSON) with the request, for `lookup` by its id."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop `request_id` wherever it is: still queued (it is dropped) or running
        in an engine (the engine frees its blocks within one step). Idempotent."""

    @abc.abstractmethod
    def events(self) -> AsyncIterator[list[TokenEvent]]:
        """Batches of TokenEvents of the requests this gateway submitted or follows,
        in publish order per request. One consumer per gateway: the app's reader
        task. Ends when the broker closes."""

    async def abort_lost(self, request_id: str) -> None:
        """Stop a request the gateway gave up on (nothing answers it: see the orphan
        deadline in docs/reliability.md), as `abort` does; a resumable broker also
        forgets it at once, so that its resume token names nothing."""
        await self.abort(request_id)

    async def reachable(self, timeout: float) -> bool:
        """Whether the broker's store answers within `timeout` seconds (`/health`)."""
        return True

    async def retire(self, request_id: str, model: str, tenant: str) -> None:  # noqa: B027 - optional hook
        """The request's client took its whole answer: nothing needs its events for a resume
        any more (a resumable broker drops them now instead of after its retention)."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """This gateway stops receiving `request_id`'s events; the request goes on."""

    async def lookup(self, request_id: str) -> Resumable | None:
        """A resumable request by its id; None when unknown or expired. The caller
        checks the resume token against the context."""
        return None

    async def follow(self, request_id: str) -> int:
        """Receive `request_id`'s events from its first one (a resume); the caller
        skips what its client already has. Returns the request's attach count (how
        many times it was resumed), for `abort_unless_resumed`."""
        raise BrokerError(f"{type(self).__name__} cannot resume requests")

    async def abort_unless_resumed(self, request_id: str, attach: int) -> bool:
        """Abort a request whose client left, unless a client resumed it since that
        client attached (`attach`: the count `follow` gave it; 0 for the client that
        started it). Returns True when it aborted."""
        await self.abort(request_id)
        return True

    async def position(self, request_id: str) -> int | None:
        """1-based place of a submitted request in its queue; 0 once an engine took
        it; None when the broker cannot tell."""
        return None

    @abc.abstractmethod
    async def engines(self) -> list[EngineInfo]:
        """Engines seen within `engine_ttl_s`."""

    async def pending(self) -> int:
        """Requests submitted and not yet pulled by an engine (best effort)."""
        return 0

    async def tokenizer_files(self, model: str) -> dict[str, bytes] | None:
        """The tokenizer files an engine of `model` published (`publish_tokenizer`);
        None when no engine did (the gateway then needs the files locally)."""
        return None

    async def command(
        self, model: str, command: AdapterCommand, engines: int, timeout: float
    ) -> list[AdapterReply]:
        """Send `command` to every engine of `model` and gather their replies: until
        `engines` replied or `timeout` seconds passed (an engine that does not answer in
        time is left out). BrokerUnavailable while the store is down."""
        raise BrokerError(f"{type(self).__name__} cannot send commands to its engines")

    def limiter(self) -> Limiter:
        """The per-tenant rate limiter for the gateways of this deployment: in this
        process (the default), or shared through the store every gateway uses."""
        return MemoryLimiter()

    def response_store(self) -> ResponseStore:
        """Where this deployment's gateways keep stored Responses answers: in this
        process (the default), or in the store every gateway uses."""
        return MemoryResponseStore()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop everything: events() ends, submit() raises (and, on a broker that
        is both sides, pull() returns [] and publish() drops)."""

    def _alive(self, infos: list[EngineInfo]) -> list[EngineInfo]:
        now = time.time()
        return [i for i in infos if now - i.last_seen <= self.engine_ttl_s]


class EngineBroker(abc.ABC):
    """The engine's side of a broker; call it from a worker thread or process."""

    @abc.abstractmethod
    def pull(self, max_n: int, timeout: float = 0.0, rank: Rank | None = None) -> list[GenerateRequest]:
        """Take up to `max_n` queued requests. Waits up to `timeout` seconds for the
        first one; returns [] when none came. Both brokers take by priority, then
        tenants in turn (fair_queue.py); with `rank` (the engine's admission order:
        lower first) the memory broker orders a level's tenants by it first, while the
        Redis queue (shared by engines with different ranks) keeps its own turns."""

    @abc.abstractmethod
    def aborts(self) -> list[str]:
        """Request ids aborted since the last call (each at most once). Never blocks."""

    @abc.abstractmethod
    def publish(self, events: list[TokenEvent]) -> None:
        """Send one engine step's events to the gateways waiting for them. May block
        while the gateway side is full (backpressure), never forever."""

    @abc.abstractmethod
    def heartbeat(self, info: EngineInfo) -> None:
        """Register the engine or refresh it (its stats and `last_seen`)."""

    def publish_tokenizer(self, model: str, files: dict[str, bytes]) -> None:  # noqa: B027
        """Make `model`'s tokenizer files readable by every gateway (`tokenizer_files`).
        A broker within one process has no need: its gateway reads the directory."""

    def deregister(self, engine_id: str) -> None:  # noqa: B027 - optional hook
        """The engine leaves cleanly; gateways stop counting it at once."""

    def dead_letter(self, item: object, reason: str) -> None:
        """Put aside something the engine received and cannot serve at all (it is
        not a valid request), with the reason. Brokers that keep a dead-letter stream
        keep it there; the worker has already failed the request."""
        log.error("dead letter (%s): %r", reason, item)

    def routes_by_prefix(self) -> bool:
        """Whether this broker routes requests to the engine that caches their prefix: then
        `publish_prefix` hears which prefix blocks this engine caches."""
        return False

    def publish_prefix(self, block_size: int, keys: list[bytes]) -> None:  # noqa: B027 - optional hook
        """The chain keys of the prefix blocks this engine caches (`routes_by_prefix`)."""

    def commands(self) -> list[AdapterCommand]:
        """Adapter commands sent to this engine's model since the last call (each once),
        for the worker to apply and answer with `reply`. Never blocks."""
        return []

    def reply(self, reply: AdapterReply) -> None:  # noqa: B027 - optional hook
        """Answer a command from `commands()` (the gateway waits for it)."""

    def release(self, request_ids: list[str], stalled: bool = False) -> list[str]:
        """Hand requests this engine pulled back to the queue, for another engine to
        finish (graceful shutdown; `stalled`: the engine is stuck, its watchdog gave up on
        it). Each keeps its count of deliveries, and of the stalled engines that held it:
        a request a stalled engine had handed on before is not handed on again (at most
        `STALL_HANDOFFS` times: a request of death reaches two engines, never a third).
        Returns those it could not hand back; the worker fails them with `worker_lost`
        (`engine_stalled` when stalled)."""
        return list(request_ids)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop everything: pull() returns [], publish() drops what it is given."""


class Broker(GatewayBroker, EngineBroker):
    """Both sides in one object, as the memory and Redis brokers are: a process uses
    the side it plays (a gateway, an engine worker, or both in `wsllm serve`)."""
