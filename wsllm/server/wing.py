"""What an API's wing (`wsllm/server/api/<name>/`) gives the app: its HTTP routes, each
an `http.Endpoint` mounted with `http.route`, and the WebSocket message kinds it answers
(`WsKind`), which the WebSocket session runs after the same admission as the routes.
The app mounts each wing with one line (app.py, `WINGS`); ws.py knows only these kinds,
never a wing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from starlette.routing import BaseRoute

from wsllm.config_gateway import GatewayConfig
from wsllm.server.admission import Admission
from wsllm.server.quota import Charge
from wsllm.server.resume import Api
from wsllm.server.tenants import Tenant

Req = TypeVar("Req")


@dataclass(slots=True)
class WsRun:
    """A WebSocket request of a wing's kind, started: the fields of its `started` message
    (None: it sends none), the messages it sends (the session adds their `id`), and how
    it stops (a `cancel`, or the socket's close: nothing of it outlives the socket)."""

    started: dict[str, Any] | None
    messages: AsyncIterator[dict[str, Any]]
    stop: Callable[[], Awaitable[None]]
    #: how it leaves when the socket closes (a chat request detaches where the broker keeps it,
    #: for its owner's `resume`); None: it stops
    leave: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True, slots=True)
class WsKind(Generic[Req]):
    """A WebSocket message type a wing answers: the same validation, charge and work as
    its HTTP route, on the message's fields (all but `type` and `id`). A kind without a
    charge is not admitted by the session: it takes what it needs itself (a resume: one rpm
    and the request's lease, `Gateway.resume`), from the tenant (`resume`)."""

    api: Api
    validate: Callable[[dict[str, Any], GatewayConfig], Req]
    charge: Callable[[Req, GatewayConfig], Charge] | None = None
    run: Callable[[Admission, Req], Awaitable[WsRun]] | None = None
    resume: Callable[[Tenant, Req], Awaitable[WsRun]] | None = None


@dataclass(slots=True)
class Wing:
    routes: Sequence[BaseRoute]
    #: WebSocket message type -> the kind that answers it
    ws: dict[str, WsKind[Any]] = field(default_factory=dict)
