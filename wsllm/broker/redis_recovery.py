"""Taking over the requests of an engine that stopped (crash, kill, hang): the
claiming engine runs `XAUTOCLAIM` with the lease as the minimum idle time (live
engines keep their entries fresh with each heartbeat), reads each claimed request's
result stream, and decides by `replay.plan`: run it again, replay it past what the
client has, end it with `worker_lost`, or dead-letter it after too many deliveries.
It also removes the consumers of engines that are gone and hold nothing.

One engine of a model scans at a time: a reclaim first takes the model's turn (`SET NX
PX` of `{queue}:rc` for the interval), so a model's pending list is scanned once per
interval, not once per engine (64 engines scanning a few hundred pending entries every
2 s took a third of a Redis core's budget in `bench/broker_scale.py`), and a scan visits
at most `RECLAIM_PAGE` x 10 entries (XAUTOCLAIM's own bound), going round by its cursor.

`Recovery` only reads Redis and decides; the engine side (`redis_engine.RedisEngine`)
applies each `Decision` (hold the request, ack it, send its last event, dead-letter
it), so the two never reach into each other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from wsllm.broker.redis_keys import GROUP, Keys
from wsllm.broker.replay import History, Plan, Replay, error_event, plan
from wsllm.config_redis import RedisConfig
from wsllm.types import GenerateRequest, TokenEvent, WireError
from wsllm.wire import decode_events, decode_request

log = logging.getLogger(__name__)

Entry = tuple[str, dict[bytes, bytes]]  # (entry id, its fields)

#: entries one XAUTOCLAIM may claim (it visits at most ten times as many)
RECLAIM_PAGE = 32


def reclaim_interval_s(lease_s: float) -> float:
    """How often a model's pending list is scanned for entries past their lease."""
    return min(lease_s / 4, 2.0)


@dataclass(slots=True)
class Decision:
    """What to do with one claimed (or handed-back) queue entry."""

    entry_id: str
    fields: dict[bytes, bytes]
    plan: Plan
    request: GenerateRequest | None = None  # None: the entry is not a valid request
    replay: Replay | None = None  # Plan.REPLAY: drops what the client already has
    final: TokenEvent | None = None  # Plan.LOST / DEAD: the request's last event
    reason: str = ""  # Plan.DEAD: why, for the dead-letter stream
    marks: tuple[int, int] = (1, 0)  # its deliveries (this one's included) and stalls so far


class Recovery:
    def __init__(self, r: Any, keys: Keys, cfg: RedisConfig, model: str, consumer: str) -> None:
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.model = model
        self.queue = keys.queue(model)
        self.consumer = consumer
        self._cursor = "0-0"  # XAUTOCLAIM goes round the pending list in pages
        self._next_cleanup = 0.0

    def reclaim(self, count: int, held: set[str]) -> list[Decision]:
        """Take up to `count` entries idle longer than the lease (their engine
        stopped refreshing it), leaving out those this engine holds (`held`)."""
        lease_ms = int(self.cfg.lease_s * 1000)
        turn_ms = max(1, int(reclaim_interval_s(self.cfg.lease_s) * 1000))
        if not self.r.set(f"{self.queue}:rc", self.consumer, nx=True, px=turn_ms):
            return []  # another engine of the model scans in this interval
        resp = self.r.xautoclaim(
            self.queue, GROUP, self.consumer, lease_ms, self._cursor, count=min(count, RECLAIM_PAGE)
        )
        cursor, claimed = resp[0], resp[1]
        self._cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        entries = [(i.decode(), f) for i, f in claimed if f and i.decode() not in held]
        if time.monotonic() >= self._next_cleanup:
            self._next_cleanup = time.monotonic() + self.cfg.lease_s
            self._remove_dead_consumers()
        if not entries:
            return []
        log.warning("%s: reclaimed %d requests from engines that stopped", self.consumer, len(entries))
        return self.decide(entries)

    def decide(self, entries: list[Entry]) -> list[Decision]:
        """How to go on with each entry, from its request's result stream."""
        if not entries:
            return []
        reqs: list[GenerateRequest | WireError] = []
        pipe = self.r.pipeline(transaction=False)
        for entry_id, fields in entries:
            try:
                req: GenerateRequest | WireError = decode_request(fields.get(b"r", b""))
            except WireError as e:
                req = e
            reqs.append(req)
            if isinstance(req, GenerateRequest):
                pipe.xrange(self.keys.out(self.model, req.request_id))
                results_key, start = self._results_of(fields, entry_id)
                if results_key:  # what the history stream does not have yet
                    pipe.xrange(results_key, start, "+")
            pipe.xpending_range(self.queue, GROUP, entry_id, entry_id, 1)
        results = iter(pipe.execute())
        out = []
        for (entry_id, fields), req in zip(entries, reqs, strict=True):
            stream = next(results) if isinstance(req, GenerateRequest) else None
            if stream is not None and self._results_of(fields, entry_id)[0]:
                stream = (stream, next(results))
            pend = next(results)
            before, stalls = marks_of(fields)  # a hand-back's new entry counts from its first
            deliveries = before + (int(pend[0]["times_delivered"]) if pend else 1)
            if not isinstance(req, GenerateRequest):
                out.append(Decision(entry_id, fields, Plan.DEAD, reason=f"invalid request entry: {req}"))
            else:
                d = self._decide_one(entry_id, fields, req, stream or [], deliveries)
                d.marks = (deliveries, stalls)
                out.append(d)
        return out

    def _decide_one(
        self,
        entry_id: str,
        fields: dict[bytes, bytes],
        req: GenerateRequest,
        stream: Any,
        deliveries: int,
    ) -> Decision:
        rid = req.request_id
        req.queue_deadline = 0.0  # an engine took it before: no longer a waiting request
        own, tail = stream if isinstance(stream, tuple) else (stream, [])
        if not own:  # its history stream expired: nobody waits for it any more
            return Decision(entry_id, fields, Plan.DONE, req)
        try:
            # Its history, then its gateway's results stream from its start: a copy of
            # what the history has is dropped by seq (History.add).
            batches = [decode_events(f[b"e"]) for _, f in own if b"e" in f]
            batches += [
                [e for e in decode_events(f[b"e"]) if e.request_id == rid] for _, f in tail or [] if b"e" in f
            ]
            history = History.of(batches)
        except WireError as e:
            msg = f"the request's result stream cannot be read ({e})"
            return Decision(entry_id, fields, Plan.LOST, req, final=TokenEvent.lost(rid, msg))
        what = plan(req, history, deliveries, self.cfg.max_deliveries)
        log.info("%s: request %s (delivery %d, %d events sent): %s", self.consumer, rid, deliveries,
                 history.num_events, what.value)  # fmt: skip
        if what is Plan.REPLAY:
            return Decision(entry_id, fields, what, req, replay=Replay(rid, history))
        if what is Plan.DEAD:
            msg = f"the request failed on {deliveries - 1} engines and was moved to the dead-letter stream"
            return Decision(
                entry_id,
                fields,
                what,
                req,
                final=error_event(rid, history, msg),
                reason=f"delivered {deliveries} times",
            )
        if what is Plan.LOST:
            msg = "the engine serving this request was lost mid-answer (not greedy or seeded: cannot resume)"
            return Decision(entry_id, fields, what, req, final=error_event(rid, history, msg))
        return Decision(entry_id, fields, what, req)

    def _results_of(self, fields: dict[bytes, bytes], entry_id: str) -> tuple[str, str]:
        return results_of(fields, entry_id, self.keys.model_tag(self.model))

    def _remove_dead_consumers(self) -> None:
        """Consumers of engines that are gone and hold nothing any more."""
        idle_ms = int(self.cfg.lease_s * 2000)
        for c in self.r.xinfo_consumers(self.queue, GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.consumer or c["pending"] or c["idle"] < idle_ms:
                continue
            if not self.r.exists(self.keys.engine(name)):
                self.r.xgroup_delconsumer(self.queue, GROUP, name)
                log.info("%s: removed the consumer of gone engine %s", self.consumer, name)


def marks_of(fields: dict[bytes, bytes]) -> tuple[int, int]:
    """What a handed-back entry carries of its request's past (`redis_registry.release`):
    its deliveries before this entry (`dv`) and the stalled engines that held it and
    handed it on (`x`); (0, 0) for a new entry, or marks that are not counts."""

    def count(key: bytes) -> int:
        raw = fields.get(key, b"0")
        return int(raw) if raw.isdigit() and len(raw) < 6 else 0

    return count(b"dv"), count(b"x")


def results_of(fields: dict[bytes, bytes], entry_id: str, tag: str) -> tuple[str, str]:
    """A queue entry's results stream (`s`; "" when none, or when it is not in the
    model's slot, `tag`) and the id its events there start from (`st` of a handed-back
    entry, else the entry's own id)."""
    results = fields.get(b"s", b"").decode(errors="replace")
    start = fields.get(b"st", b"").decode(errors="replace") or entry_id
    return (results if results.startswith(tag + ":") else ""), start
