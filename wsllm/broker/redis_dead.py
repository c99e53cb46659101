"""The dead-letter stream (`{p}:dead:{model}`): queue and abort entries that no engine
can serve, each with the reason, so that an operator can look at them and nothing
is lost silently. Moving an entry there takes it out of its stream in the same step."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from wsllm.bounds import MAX_ID_CHARS
from wsllm.broker.redis_keys import GROUP, UNAVAILABLE, Keys
from wsllm.broker.redis_queue import taken_key
from wsllm.broker.redis_recovery import results_of
from wsllm.config_redis import RedisConfig
from wsllm.types import ERR_INVALID_REQUEST, TokenEvent
from wsllm.wire import encode

log = logging.getLogger(__name__)

ABORT_REASON = "invalid abort entry: it must have exactly one field, r, a request id"


class DeadLetters:
    def __init__(self, r: Any, keys: Keys, cfg: RedisConfig, model: str, queue: str) -> None:
        self.r = r
        self.keys = keys
        self.cfg = cfg
        self.model = model
        self.queue = queue
        self.stream = keys.dead(model)

    def request_entry(
        self, entry_id: str, fields: dict[bytes, bytes], reason: str, final: TokenEvent | None = None
    ) -> None:
        """Move a queue entry here (ack and delete it in the queue). Its client, when
        the entry names a request a gateway waits for, gets `final`, or an
        `invalid_request` error that carries the reason."""
        rid = final.request_id if final is not None else _request_id_of(fields)
        dead = dict(fields) | {
            b"reason": reason.encode(),
            b"entry": entry_id.encode(),
            b"model": self.model.encode(),
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.stream, dead, maxlen=self.cfg.dead_letter_maxlen)
        pipe.xack(self.queue, GROUP, entry_id)
        pipe.xdel(self.queue, entry_id)
        if rid:
            pipe.hdel(taken_key(self.queue), rid)
            ev = final or TokenEvent.failure(
                rid, ERR_INVALID_REQUEST, f"the engine cannot serve it: {reason}"
            )
            pipe.xadd(self.keys.out(self.model, rid), {"e": encode([ev])}, nomkstream=True)
            pipe.pexpire(self.keys.out(self.model, rid), int(self.cfg.stream_retention_s * 1000))
            results = self._results(rid, fields)
            if results:  # its gateway reads that one
                pipe.xadd(results, {"e": encode([ev])})
                pipe.pexpire(results, self.cfg.results_ttl_ms)
        pipe.execute()
        log.error("dead-lettered queue entry %s (%s)", entry_id, reason)

    def _results(self, rid: str, fields: dict[bytes, bytes]) -> str:
        """The results stream the request's gateway reads: the entry's, or (a malformed
        entry may lack it) the one its meta names."""
        tag = self.keys.model_tag(self.model)
        results, _ = results_of(fields, "", tag)
        if not results:
            first = self.r.xrange(self.keys.out(self.model, rid), count=1)
            results, _ = results_of(first[0][1] if first else {}, "", tag)
        return results

    def item(self, item: object, reason: str) -> None:
        """Something the worker received and cannot serve (already out of the queue)."""
        dead = {
            b"item": repr(item)[:10000].encode(),
            b"reason": reason.encode(),
            b"model": self.model.encode(),
        }
        try:
            self.r.xadd(self.stream, dead, maxlen=self.cfg.dead_letter_maxlen)
        except UNAVAILABLE:
            log.error("dead letter lost while redis is unreachable (%s): %r", reason, item)

    def abort_entry(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """A malformed abort entry. Every engine of the model reads the abort stream; the
        one whose XDEL removes it moves it here, exactly once."""
        dead = dict(fields) | {
            b"reason": ABORT_REASON.encode(),
            b"entry": entry_id.encode(),
            b"stream": b"aborts",
            b"model": self.model.encode(),
        }
        try:
            if not self.r.xdel(self.keys.aborts(self.model), entry_id):
                return  # another engine moved it
            self.r.xadd(self.stream, dead, maxlen=self.cfg.dead_letter_maxlen)
        except UNAVAILABLE:
            return  # it stays in the abort stream (or is lost with Redis); engines that read it later try again
        log.error("dead-lettered abort entry %s", entry_id)


def abort_target(fields: dict[bytes, bytes]) -> str | None:
    """The request id of a valid abort entry (exactly `r`: a short UTF-8 id), else None."""
    raw = fields.get(b"r")
    if len(fields) != 1 or not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_ID_CHARS:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _request_id_of(fields: dict[bytes, bytes]) -> str:
    """The request id an invalid request entry names, if any (to tell its client)."""
    try:
        rid = orjson.loads(fields.get(b"r", b""))["item"]["request_id"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return ""
    return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else ""
