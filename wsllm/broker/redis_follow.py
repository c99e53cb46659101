"""What a gateway keeps per followed request, and the checks on each event it reads
from the request's result stream (`redis_gateway.RedisGateway`'s reader): duplicates
(a retried publish) are dropped and a gap ends the request with `worker_lost`.

A follow is replaced, not updated, when its request is followed again (a resume on
the same gateway): the new one reads the request from its start. The reader hands
each event on with the follow it was checked against (`Read`), and the gateway drops
those whose follow went stale before they were routed: they were read for the old
client, and a new one gets them again, in order, from the history."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from wsllm.types import TokenEvent
from wsllm.wire import decode_events


@dataclass(slots=True)
class Follow:
    """A request whose result stream this gateway reads."""

    model: str
    last_id: str = "0-0"  # read up to here in its history stream
    n: int = 1
    results: str = ""  # the results stream its events come through ("": only its history)
    tail_id: str = "0-0"  # read up to here in that results stream
    history: bool = False  # followed from its start (a resume): read its history stream too
    next_seq: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    #: replaced by a new follow (a resume) or forgotten by its client: the events read
    #: for it and not yet handed on are dropped
    stale: bool = False


# An event as the reader passed it, with the follow it was checked against (None: an
# event of no follow, such as a request lost while Redis was away).
Read = tuple[TokenEvent, Follow | None]


def entry_events(f: Follow, fields: dict[bytes, bytes]) -> list[TokenEvent]:
    """The events of one result-stream entry (the meta entry has none)."""
    if b"m" in fields:
        n = orjson.loads(fields[b"m"]).get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"bad choice count {n!r}")
        f.n = n
    if b"e" not in fields:
        return []
    return decode_events(fields[b"e"])


def checked(rid: str, f: Follow, ev: TokenEvent) -> TokenEvent | None:
    """Drop duplicates and events of another request; turn a gap into worker_lost."""
    if ev.request_id != rid:
        return None
    if ev.seq >= 0 and not ev.ends_request and not ev.whole_request:
        want = f.next_seq.get(ev.index, 0)
        if ev.seq < want:
            return None
        if ev.seq > want:
            return TokenEvent.lost(rid, f"events {want}..{ev.seq - 1} of this request were lost")
        f.next_seq[ev.index] = want + 1
    if ev.finish_reason is not None and not ev.whole_request:
        f.done.add(ev.index)
    return ev
