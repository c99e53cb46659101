"""What an engine worker remembers of the requests its engine holds (`LiveRequests`):
per request, the `seq` of each choice's next event and the choices already ended; and
the one translation of an engine step's outputs into the TokenEvents the worker
publishes (`events_of`), so that every choice's events are numbered from 0 without a
gap, once, whoever ends the request (a finish, an engine error, the worker failing it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from wsllm.types import TokenEvent, Usage


@dataclass(slots=True)
class _Live:
    next_seq: dict[int, int] = field(default_factory=dict)  # choice index -> seq of its next event
    finished: set[int] = field(default_factory=set)  # choice indexes already ended


class LiveRequests:
    """The requests one worker's engine holds, by id. Driven by the worker's thread; a
    watchdog that gives up on a stuck engine reads it from its own (`ids` copies)."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Live] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_id))

    def ids(self) -> list[str]:
        return list(self._by_id)

    def add(self, request_id: str) -> None:
        self._by_id[request_id] = _Live()

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def failure(self, request_id: str, code: str, message: str) -> TokenEvent:
        """The error event that ends `request_id` (dropped), numbered after its last event."""
        live = self._by_id.pop(request_id, None)
        seq = 0 if live is None else live.next_seq.get(0, 0)
        return TokenEvent.failure(request_id, code, message, seq=seq)

    def events_of(self, out: Any) -> list[TokenEvent]:
        """The events of one engine output (a RequestOutput); none for a request this
        worker did not add. A request that finished or failed is dropped."""
        live = self._by_id.get(out.request_id)
        if live is None:
            return []
        if out.error_code is not None:  # the engine could not serve it: one error event
            del self._by_id[out.request_id]
            seq = min((live.next_seq.get(c.index, 0) for c in out.outputs), default=0)
            return [TokenEvent.failure(out.request_id, out.error_code, out.error or "", seq=seq)]
        events = []
        for c in out.outputs:
            if c.index in live.finished or (not c.new_token_ids and c.finish_reason is None):
                continue
            seq = live.next_seq.get(c.index, 0)
            live.next_seq[c.index] = seq + 1
            ev = TokenEvent(
                request_id=out.request_id,
                seq=seq,
                token_ids=list(c.new_token_ids),
                index=c.index,
                finish_reason=c.finish_reason,
                logprobs=c.new_logprobs,
            )
            if seq == 0:
                ev.queue_time = out.queue_time
            if c.finish_reason is not None:
                live.finished.add(c.index)
                ev.usage = Usage(out.num_prompt_tokens, c.num_tokens, out.num_cached_tokens)
                ev.usage.drafted_tokens, ev.usage.accepted_tokens = out.num_drafted, out.num_accepted
                ev.embedding = out.embedding  # an embedding request's vector, on its one event
            events.append(ev)
        if out.prompt_logprobs is not None and events:  # once per request, on its first event here
            events[0].prompt_logprobs = out.prompt_logprobs
        if out.finished:
            del self._by_id[out.request_id]
        return events
