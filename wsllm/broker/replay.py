"""Crash replay: picking up a request that another engine started (it crashed, or
handed the request back on shutdown). Plain Python, no Redis: tested on its own.
(Not to be confused with a *client* resuming its stream, which is the gateway's.)

The request's result stream says what its client was already sent. A request that
sent nothing runs again from the start. A greedy or seeded request runs again too,
and `Replay` drops the tokens the client already has (checking they are the same
tokens) and numbers the rest after them, so the client sees no gap and no duplicate.
Anything else ends with an explicit `worker_lost` error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from wsllm.types import ERR_WORKER_LOST, FINISH_ABORT, FINISH_ERROR, GenerateRequest, TokenEvent


@dataclass(slots=True)
class History:
    """What a request's result stream holds, per choice."""

    sent: dict[int, list[int]] = field(default_factory=dict)  # token ids sent so far
    next_seq: dict[int, int] = field(default_factory=dict)  # seq of the next event
    done: set[int] = field(default_factory=set)  # choices that ended
    ended: bool = False  # an error, or an abort of the whole request
    num_events: int = 0

    @classmethod
    def of(cls, batches: list[list[TokenEvent]]) -> History:
        h = cls()
        for batch in batches:
            for ev in batch:
                h.add(ev)
        return h

    def add(self, ev: TokenEvent) -> None:
        if ev.ends_request:  # a failure, or a gateway's abort of the whole request
            self.num_events += 1
            self.ended = True
            return
        if ev.whole_request:
            return
        want = self.next_seq.get(ev.index, 0)
        if 0 <= ev.seq < want:  # a retried publish wrote it twice: the client got it once
            return
        self.num_events += 1
        self.sent.setdefault(ev.index, []).extend(ev.token_ids)
        if ev.seq >= 0:
            self.next_seq[ev.index] = ev.seq + 1
        if ev.finish_reason is not None:
            self.done.add(ev.index)

    def finished(self, n: int) -> bool:
        return self.ended or len(self.done) >= n


class Plan(enum.Enum):
    FRESH = "fresh"  # nothing was sent: run it as if new
    REPLAY = "replay"  # run it again and skip what was sent
    DONE = "done"  # it ended already (finished, failed or aborted): just ack it
    LOST = "lost"  # tokens were sent and cannot be reproduced: worker_lost
    DEAD = "dead"  # delivered too often: dead-letter it


def reproducible(request: GenerateRequest) -> bool:
    p = request.params
    return (p.greedy or p.seed is not None) and not p.use_beam_search


def plan(request: GenerateRequest, history: History, deliveries: int, max_deliveries: int) -> Plan:
    if history.finished(request.params.n):
        return Plan.DONE
    if deliveries > max_deliveries:
        return Plan.DEAD
    if history.num_events == 0:
        return Plan.FRESH
    return Plan.REPLAY if reproducible(request) else Plan.LOST


def error_event(request_id: str, history: History, message: str, code: str = ERR_WORKER_LOST) -> TokenEvent:
    return TokenEvent.failure(request_id, code, message, seq=history.next_seq.get(0, 0))


class Replay:
    """Filters a re-run's events for one request."""

    def __init__(self, request_id: str, history: History) -> None:
        self.request_id = request_id
        self.history = history
        self._consumed: dict[int, int] = {}  # per choice: regenerated tokens matched so far
        self.failed = False

    def filter(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """The events to send. After a mismatch: one worker_lost error, then nothing
        (`failed` is set and the caller aborts the engine request)."""
        out: list[TokenEvent] = []
        for ev in events:
            if self.failed:
                break
            kept = self._one(ev)
            if kept is not None:
                out.append(kept)
        return out

    def _one(self, ev: TokenEvent) -> TokenEvent | None:
        h = self.history
        i = ev.index
        if i in h.done:
            return None
        if ev.finish_reason in (FINISH_ERROR, FINISH_ABORT) and not ev.token_ids:
            return replace(ev, seq=self._take_seq(i))
        sent = h.sent.get(i, [])
        start = self._consumed.get(i, 0)
        k = min(len(sent) - start, len(ev.token_ids))
        if k > 0:
            if ev.token_ids[:k] != sent[start : start + k]:
                return self._fail("the re-run produced different tokens than the ones already sent")
            self._consumed[i] = start + k
        if self._consumed.get(i, 0) < len(sent) and ev.finish_reason is not None:
            return self._fail("the re-run ended before it caught up with what was already sent")
        tokens = ev.token_ids[max(k, 0) :]
        if not tokens and ev.finish_reason is None:
            return None
        logprobs = ev.logprobs[max(k, 0) :] if ev.logprobs is not None else None
        queue_time = ev.queue_time if i not in h.next_seq else None
        return replace(ev, seq=self._take_seq(i), token_ids=tokens, logprobs=logprobs, queue_time=queue_time)

    def _take_seq(self, index: int) -> int:
        seq = self.history.next_seq.get(index, 0)
        self.history.next_seq[index] = seq + 1
        return seq

    def _fail(self, why: str) -> TokenEvent:
        self.failed = True
        return error_event(self.request_id, self.history, f"the engine serving this request was lost; {why}")
