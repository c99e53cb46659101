"""The gateway's reader of one model's results (`redis_gateway.RedisGateway.events`
runs one per model: a model's keys share one cluster slot, and a blocking read over
several keys must stay inside one).

One blocking `XREAD` per round over:
- the gateway's own results stream of the model (`{model}:r:{gateway}`), always: the
  engines write each step's events of all of this gateway's requests there in one
  entry, so a new request needs no wake-up and a step costs one read;
- the history stream (`{model}:o:{rid}`) of each request followed from its start (a
  resume) and the results stream it was submitted through (another gateway's,
  perhaps) from the request's start: the history holds what was copied there so far,
  the results stream what came since (and, within `results_tail_s`, a copy of the
  history; duplicates are dropped by `seq`);
- the gateway's wake-up stream of the model (a resume, or close()).

Each follow keeps its own cursor in the results stream it reads, and the read starts
from the lowest of them; an entry reaches a follow only when it lies past the
follow's cursor and the follow was there when the read was sent, or is a new
request that joined at or after the read's cursor (a resume that joined during a
read has its cursor behind it, and gets those entries from the next read, after its
history).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson
import redis.exceptions

from wsllm.broker.redis_conn import reader_client
from wsllm.broker.redis_follow import Follow, Read, checked, entry_events
from wsllm.broker.redis_keys import UNAVAILABLE
from wsllm.types import TokenEvent, WireError
from wsllm.wire import decode_events

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # the reader re-checks close() at least this often
_CLOSE_S = 2.0
_BAD = (WireError, orjson.JSONDecodeError, TypeError, ValueError, AttributeError)


def sid(entry_id: str) -> tuple[int, int]:
    """A stream entry id as numbers, for comparing."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _raise_if_cancelled() -> None:
    """A cluster client can turn the cancel of a blocked read into a connection error:
    the reader must still stop, not retry."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass(slots=True)
class _Round:
    """What one read was sent for."""

    history: dict[str, tuple[str, Follow]]  # history stream -> (request id, follow)
    live: dict[str, dict[str, Follow]]  # results stream -> request id -> follow
    cursors: dict[str, str]  # results stream -> where the read starts


class ModelReader:
    def __init__(self, gw: Any, model: str) -> None:  # a redis_gateway.RedisGateway (it imports this module)
        self.gw = gw
        self.model = model
        self.own = gw.keys.results(model, gw.gateway_id)
        self.wake_key = gw.keys.wake(model, gw.gateway_id)
        self.cursor = "0-0"  # in the own results stream (new for each gateway process)

    def _round(self) -> _Round:
        r = _Round({}, {self.own: {}}, {self.own: self.cursor})
        for rid, f in self.gw.follows_of(self.model):
            if f.history:
                r.history[self.gw.keys.out(self.model, rid)] = (rid, f)
            if f.results:
                r.live.setdefault(f.results, {})[rid] = f
                at = r.cursors.get(f.results)
                if at is None or sid(f.tail_id) < sid(at):
                    r.cursors[f.results] = f.tail_id
        return r

    async def _check_followed(self) -> list[TokenEvent]:
        """After an outage: end the followed requests that Redis no longer knows (it may
        have restarted empty)."""
        rids = [rid for rid, _ in self.gw.follows_of(self.model)]
        if not rids:
            return []
        pipe = self.gw.client().pipeline(transaction=False)
        for rid in rids:
            pipe.xrange(self.gw.keys.out(self.model, rid), count=1)
        lost = []
        for rid, first in zip(rids, await pipe.execute(), strict=True):
            if not first or b"m" not in first[0][1]:
                self.gw.forget(rid)
                lost.append(TokenEvent.lost(rid, "the broker restarted and lost this request"))
        return lost

    async def run(self, out: asyncio.Queue[list[Read]]) -> None:
        reader: Any = None
        wake_id = "$"
        broken = False
        try:
            while not self.gw.closing:
                if reader is None:
                    try:
                        reader = await reader_client(self.gw.url, self.gw.cfg, self.own, READ_BLOCK_MS / 1000)
                    except (*UNAVAILABLE, redis.exceptions.RedisError) as e:
                        log.warning("no connection for the reader of %s (%s); retrying", self.model, e)
                        await asyncio.sleep(0.5)
                        continue
                rnd = self._round()
                streams = (
                    {self.wake_key: wake_id}
                    | rnd.cursors
                    | {k: f.last_id for k, (_, f) in rnd.history.items()}
                )
                try:
                    if wake_id == "$":  # resolve "$" once, or a wake-up between reads would be missed
                        last = await reader.xrevrange(self.wake_key, count=1)
                        wake_id = streams[self.wake_key] = last[0][0].decode() if last else "0-0"
                    resp = await reader.xread(streams, block=READ_BLOCK_MS)
                    if broken:
                        broken = False
                        log.warning("redis is back; checking the followed requests of %s", self.model)
                        lost = await self._check_followed()
                        if lost:
                            out.put_nowait([(ev, None) for ev in lost])
                except UNAVAILABLE as e:
                    _raise_if_cancelled()
                    if not broken:
                        log.warning("redis unreachable (%s); the reader of %s retries", e, self.model)
                    broken = True
                    await asyncio.sleep(0.5)
                    continue
                except redis.exceptions.RedisError as e:  # never let the reader die: /ready depends on it
                    _raise_if_cancelled()
                    if str(e).startswith(("MOVED", "ASK", "CLUSTERDOWN")):  # the slot moved: find its node
                        log.warning("the slot of %s moved (%s); reconnecting its reader", self.model, e)
                        await self._close(reader)
                        reader = None
                    else:
                        log.exception("reading the result streams of %s failed; retrying", self.model)
                    await asyncio.sleep(0.5)
                    continue
                got = {k.decode(): entries for k, entries in resp or []}
                if self.wake_key in got:
                    wake_id = got[self.wake_key][-1][0].decode()
                batch: list[Read] = []
                for key, (
                    rid,
                    f,
                ) in rnd.history.items():  # histories first: the results streams go on from them
                    if key in got:
                        batch.extend(self._take(rid, f, got[key]))
                for key, follows in rnd.live.items():
                    if key in got:
                        batch.extend(self._take_live(key, follows, rnd.cursors[key], got[key]))
                if batch:
                    out.put_nowait(batch)
            out.put_nowait([])  # closed: events() ends now
        finally:
            await self._close(reader)

    @staticmethod
    async def _close(reader: Any) -> None:
        if reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader.aclose(), _CLOSE_S)

    def _take(self, rid: str, f: Follow, entries: list[Any]) -> list[Read]:
        """Entries of a request's history stream."""
        if self.gw.follows.get(rid) is not f:  # forgotten, or followed anew (a resume), meanwhile
            return []
        out: list[Read] = []
        for entry_id, fields in entries:
            f.last_id = entry_id.decode()
            try:
                events = entry_events(f, fields)
            except _BAD as e:  # one bad entry ends its own request, and nothing else
                log.error("unreadable entry %s of %s: %s", entry_id, rid, e)
                out.append((TokenEvent.lost(rid, "the engine sent an event this gateway cannot read"), f))
                self.gw.ended(rid)
                return out
            if self._apply(rid, f, events, out):
                return out
        return out

    def _take_live(self, key: str, follows: dict[str, Follow], start: str, entries: list[Any]) -> list[Read]:
        """Entries of a results stream: each step's events of many requests."""
        out: list[Read] = []
        last = start
        # A new request of this gateway joined during the read at the cursor it started
        # from (or later): the read covers it too. A resume needs its history first.
        joined = {
            rid: f
            for rid, f in self.gw.follows_of(self.model)
            if rid not in follows and not f.history and f.results == key and sid(f.tail_id) >= sid(start)
        }
        follows = follows | joined
        for entry_id, fields in entries:
            last = entry_id.decode()
            at = sid(last)
            try:
                events = decode_events(fields[b"e"]) if b"e" in fields else []
            except (*_BAD, KeyError) as e:  # whose events they were is unknown: they are lost
                log.error("unreadable entry %s of %s: %s", last, key, e)
                continue
            by_request: dict[str, list[TokenEvent]] = {}
            for ev in events:
                by_request.setdefault(ev.request_id, []).append(ev)
            for rid, evs in by_request.items():
                f = follows.get(rid)
                if f is None or self.gw.follows.get(rid) is not f or at <= sid(f.tail_id):
                    continue
                self._apply(rid, f, evs, out)
        for f in follows.values():  # each follow has read up to here
            if sid(f.tail_id) < sid(last):
                f.tail_id = last
        if key == self.own and sid(self.cursor) < sid(last):
            self.cursor = last
        return out

    def _apply(self, rid: str, f: Follow, events: list[TokenEvent], out: list[Read]) -> bool:
        """Check and keep a request's events; True once it ended (forgotten)."""
        if events:
            self.gw.started(rid)
        for raw in events:
            ev = checked(rid, f, raw)
            if ev is None:
                continue
            out.append((ev, f))
            if ev.ends_request or len(f.done) >= f.n:
                self.gw.ended(rid)
                return True
        return False
