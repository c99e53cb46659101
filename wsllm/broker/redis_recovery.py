"""Taking over the requests of an engine that stopped (crash, kill, hang): the
claiming engine runs `XAUTOCLAIM` with the lease as the minimum idle time (live
engines keep their entries fresh with each heartbeat), reads each claimed request's
result stream, and goes on by `resume.plan`: run it again, replay it past what the
client has, end it with `worker_lost`, or dead-letter it after too many deliveries.
It also removes the consumers of engines that are gone and hold nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from wsllm.broker.redis_keys import GROUP
from wsllm.broker.resume import History, Plan, Replay, error_event, plan
from wsllm.types import GenerateRequest, TokenEvent, decode, encode

if TYPE_CHECKING:
    from wsllm.broker.redis_engine import EngineSide

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, side: EngineSide) -> None:
        self.side = side
        self._cursor = "0-0"  # XAUTOCLAIM goes round the pending list in pages
        self._next_cleanup = 0.0

    def reclaim(self, count: int) -> list[GenerateRequest]:
        """Take up to `count` entries idle longer than the lease (their engine
        stopped refreshing it) and decide what to do with each."""
        lease_ms = int(self.side.cfg.lease_s * 1000)
        resp = self.side.r.xautoclaim(
            self.side.queue, GROUP, self.side.consumer, lease_ms, self._cursor, count=count
        )
        cursor, claimed = resp[0], resp[1]
        self._cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        mine = self.side.held_entry_ids()
        entries = [(i.decode(), f) for i, f in claimed if f and i.decode() not in mine]
        if time.monotonic() >= self._next_cleanup:
            self._next_cleanup = time.monotonic() + self.side.cfg.lease_s
            self._remove_dead_consumers()
        if not entries:
            return []
        log.warning("%s: reclaimed %d requests from engines that stopped", self.side.consumer, len(entries))
        return self.recover(entries)

    def recover(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> list[GenerateRequest]:
        """Decide, from each request's result stream, how to go on with it."""
        if not entries:
            return []
        reqs: list[GenerateRequest | None] = []
        pipe = self.side.r.pipeline(transaction=False)
        for entry_id, fields in entries:
            try:
                req = decode(fields[b"r"])
                assert isinstance(req, GenerateRequest)
            except Exception:
                req = None
            reqs.append(req)
            if req is not None:
                pipe.xrange(self.side.keys.out(req.request_id))
            pipe.xpending_range(self.side.queue, GROUP, entry_id, entry_id, 1)
        results = iter(pipe.execute())
        out = []
        for (entry_id, fields), req in zip(entries, reqs, strict=True):
            stream = next(results) if req is not None else None
            pend = next(results)
            deliveries = int(pend[0]["times_delivered"]) if pend else 1
            if req is None or stream is None:
                self.side.hold(entry_id, fields)  # dead-letters it
                continue
            got = self._recover_one(entry_id, fields, req, stream, deliveries)
            if got is not None:
                out.append(got)
        return out

    def _recover_one(
        self,
        entry_id: str,
        fields: dict[bytes, bytes],
        req: GenerateRequest,
        stream: list[Any],
        deliveries: int,
    ) -> GenerateRequest | None:
        rid = req.request_id
        if not stream:  # its result stream expired: nobody waits for it any more
            self.side.ack([(entry_id, rid, "")])
            return None
        history = History.of([decode(f[b"e"]) for _, f in stream if b"e" in f])  # type: ignore[misc]
        what = plan(req, history, deliveries, self.side.cfg.max_deliveries)
        log.info("%s: request %s (delivery %d, %d events sent): %s", self.side.consumer, rid, deliveries,
                 history.num_events, what.value)  # fmt: skip
        alias = (fields.get(b"a") or b"").decode()
        if what is Plan.FRESH:
            return self.side.hold(entry_id, fields, req=req)
        if what is Plan.REPLAY:
            req.skip_tokens = max((len(t) for t in history.sent.values()), default=0)
            return self.side.hold(entry_id, fields, Replay(rid, history), req)
        if what is Plan.DEAD:
            self.dead_letter(entry_id, fields, f"delivered {deliveries} times")
            msg = f"the request failed on {deliveries - 1} engines and was moved to the dead-letter stream"
            self._send_final(rid, error_event(rid, history, msg), entry_id, alias)
        elif what is Plan.LOST:
            msg = "the engine serving this request was lost mid-answer (not greedy or seeded: cannot resume)"
            self._send_final(rid, error_event(rid, history, msg), entry_id, alias)
        else:
            self.side.ack([(entry_id, rid, alias)])
        return None

    def _send_final(self, rid: str, ev: TokenEvent, entry_id: str, alias: str) -> None:
        self.side.r.xadd(self.side.keys.out(rid), {"e": encode([ev])}, nomkstream=True)
        self.side.ack([(entry_id, rid, alias)])

    def dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        pipe = self.side.r.pipeline(transaction=True)
        dead = {k.decode(): v for k, v in fields.items()} | {
            "reason": reason,
            "entry": entry_id,
            "model": self.side.model,
        }
        pipe.xadd(self.side.keys.dead(self.side.model), dead, maxlen=self.side.cfg.dead_letter_maxlen)
        pipe.xack(self.side.queue, GROUP, entry_id)
        pipe.xdel(self.side.queue, entry_id)
        pipe.execute()
        log.error("%s: dead-lettered %s (%s)", self.side.consumer, entry_id, reason)

    def _remove_dead_consumers(self) -> None:
        """Consumers of engines that are gone and hold nothing any more."""
        idle_ms = int(self.side.cfg.lease_s * 2000)
        for c in self.side.r.xinfo_consumers(self.side.queue, GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.side.consumer or c["pending"] or c["idle"] < idle_ms:
                continue
            if not self.side.r.exists(self.side.keys.engine(name)):
                self.side.r.xgroup_delconsumer(self.side.queue, GROUP, name)
                log.info("%s: removed the consumer of gone engine %s", self.side.consumer, name)
