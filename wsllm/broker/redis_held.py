"""What one Redis engine side holds: the requests it pulled and has not finished
(`Held`, by request id), and the requests it must stop that no gateway asked to stop
(its lease was lost, its history stream is gone, its replay failed). The take, the
publish and the heartbeat each get this table, not each other: `redis_engine.py`
fills it, `redis_publish.py` writes and ends its requests, `redis_registry.py` keeps
their leases."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from wsllm.broker.replay import Replay
from wsllm.types import GenerateRequest, TokenEvent


@dataclass(slots=True)
class Held:
    """A request this engine pulled and has not finished."""

    entry_id: str
    n: int
    request: GenerateRequest
    done: set[int]
    replay: Replay | None = None
    results: str = ""  # its gateway's results stream ("": none, every step goes to its history)
    start: str = "0-0"  # the results stream holds its events from this id on
    unflushed: list[TokenEvent] = field(default_factory=list)  # not yet in its history stream
    flushed_at: float = 0.0
    dropped: bool = False  # not ours any more (lost lease, handed back): publish nothing
    aborted: bool = False  # the worker was told to abort it
    history_bytes: int = 0  # of its events written to its history stream by this engine
    deliveries: int = 1  # to any engine, this one's included (kept across hand-backs: `dv`)
    stalls: int = 0  # stalled engines that held it before and handed it on (`x`)


class HeldRequests:
    """The table; touched by the worker's thread (pull, publish, heartbeat) and by
    `release` on shutdown, so every access takes `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[str, Held] = {}
        #: the engine took its own pending entries (a restart): what it holds is its own since
        self.started = False
        self._aborts: list[str] = []  # requests to stop, for the worker's next `aborts()`

    def hold(
        self,
        entry_id: str,
        req: GenerateRequest,
        replay: Replay | None,
        results: str,
        start: str,
        marks: tuple[int, int] = (1, 0),
    ) -> bool:
        """Hold a pulled request (`marks`: its deliveries and stalls so far, this one's
        included); False when it is held already (delivered twice)."""
        with self.lock:
            if req.request_id in self.by_id:
                return False
            held = Held(entry_id, req.params.n, req, set(), replay, results, start, deliveries=marks[0])
            held.stalls, held.flushed_at = marks[1], time.monotonic()
            self.by_id[req.request_id] = held
        return True

    def get(self, rid: str) -> Held | None:
        with self.lock:
            return self.by_id.get(rid)

    def entry_ids(self) -> set[str]:
        with self.lock:
            return {h.entry_id for h in self.by_id.values()}

    def owned(self) -> dict[str, str]:
        """Entry id -> request id of what this engine still owns."""
        with self.lock:
            return {h.entry_id: rid for rid, h in self.by_id.items() if not h.dropped}

    def drop(self, rid: str) -> None:
        """The request is not ours any more: publish nothing more of it, and stop it."""
        with self.lock:
            held = self.by_id.get(rid)
            if held is not None and not held.dropped:
                held.dropped = True
                self._aborts.append(rid)

    def abort(self, rid: str) -> None:
        """The worker is to abort the request (a gateway asked, or this side decided)."""
        self._aborts.append(rid)

    def take_aborts(self) -> list[str]:
        """The requests to abort since the last call, each once."""
        out, self._aborts = self._aborts, []
        return list(dict.fromkeys(out))
