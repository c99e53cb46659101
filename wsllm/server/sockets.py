"""The WebSockets a gateway holds open (`SocketCaps`): at most `--max-sockets-per-tenant`
per tenant and `--max-sockets` in all, counted in this process (a socket is this
gateway's memory, about 85 KB of buffers, whoever's it is). `open` takes a place at the
handshake or refuses it with the reason (429 semantics; the socket is then closed with
1013, try again later), `close` gives it back when the session ends."""

from __future__ import annotations

from wsllm.server.errors import APIError
from wsllm.types import ERR_RATE_LIMITED


class SocketCaps:
    def __init__(self, per_tenant: int, total: int) -> None:
        self.per_tenant, self.total = per_tenant, total
        self._open: dict[str, int] = {}
        self._all = 0

    def open(self, tenant: str) -> None:
        """Take a place for a socket of `tenant`, or raise the 429 that says which cap."""
        if self._all >= self.total:
            raise APIError(
                429, ERR_RATE_LIMITED, f"this gateway holds {self.total} WebSockets, its most; retry later"
            )
        if self._open.get(tenant, 0) >= self.per_tenant:
            raise APIError(
                429,
                ERR_RATE_LIMITED,
                f"tenant {tenant!r} has {self.per_tenant} WebSockets open on this gateway, its most",
            )
        self._open[tenant] = self._open.get(tenant, 0) + 1
        self._all += 1

    def close(self, tenant: str) -> None:
        n = self._open.get(tenant, 0) - 1
        if n < 0:
            return
        self._all -= 1
        if n:
            self._open[tenant] = n
        else:
            del self._open[tenant]

    def count(self, tenant: str | None = None) -> int:
        return self._all if tenant is None else self._open.get(tenant, 0)
