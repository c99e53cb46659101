"""OpenAI's shapes of one request's answer: stream chunks and whole responses of
/v1/chat/completions and /v1/completions, with their logprobs (OpenAI's, and vLLM's
`prompt_logprobs`), usage, `echo`, and a batch of prompts answered as one. The routes
that send them are routes.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import orjson

from wsllm.server import textwork
from wsllm.server.chat.output import assemble_tool_calls
from wsllm.server.delta import Delta, TokenLogprob
from wsllm.server.generation import Generation
from wsllm.server.schemas import CompletionRequest
from wsllm.types import Usage


def usage_json(u: Usage) -> dict[str, Any]:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    return out | speculation_json(u)


def speculation_json(u: Usage) -> dict[str, Any]:
    """What speculative decoding did for the request, in OpenAI's names (its Predicted
    Outputs): drafted tokens accepted and rejected; nothing when none was drafted."""
    if not u.drafted_tokens:
        return {}
    details = {
        "accepted_prediction_tokens": u.accepted_tokens,
        "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens,
    }
    return {"completion_tokens_details": details}


def chat_extras(reasoning: str, tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A chat message's (or delta's) reasoning_content and tool_calls, when it has them."""
    out: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
    return out | ({"tool_calls": tool_calls} if tool_calls else {})


def _chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token: str, lp: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {
        "content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]} for t in lps]
    }


def _completion_logprobs(
    lps: list[TokenLogprob] | None, offset: int, head: EchoTable | None = None
) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of `lps`, their text starting at `offset`; `head`:
    the echoed prompt's, rendered once, before them."""
    if lps is None:
        return None
    out = EchoTable.of(lps, offset + (head.chars if head is not None else 0)).lists
    return out if head is None else {k: head.lists[k] + v for k, v in out.items()}


@dataclass(slots=True)
class EchoTable:
    """A run of tokens in OpenAI's completion logprobs, rendered: the echoed prompt's
    is made once, off the event loop, and heads each choice's first logprobs."""

    lists: dict[str, list[Any]]
    chars: int  # the characters of its tokens (text_offset goes on from there)

    @classmethod
    def of(cls, lps: list[TokenLogprob], offset: int = 0) -> EchoTable:
        offsets: list[int] = []
        start = offset
        for t in lps:
            offsets.append(offset)
            offset += len(t.token)
        lists: dict[str, list[Any]] = {
            "tokens": [t.token for t in lps],
            "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [None if t.logprob is None else dict(t.top) for t in lps],
            "text_offset": offsets,
        }
        return cls(lists, offset - start)


def _vllm_prompt_logprobs(gen: Generation) -> orjson.Fragment | None:
    """vLLM's `prompt_logprobs`, serialized: per prompt token, None for the first, else
    {token id: {"logprob", "rank" (in the top list), "decoded_token"}} for the prompt's
    token and the top ones. Prompt tokens x (top N + 1) entries (bounded by
    --max-prompt-logprobs): built once per prompt, off the event loop."""
    raw = gen.prompt_logprobs_raw
    if raw is None:
        return None
    text = gen.svc.codec.token_text
    out: list[dict[str, Any] | None] = []
    for tid, e in zip(gen.prompt_ids_for_logprobs, raw, strict=False):
        if e is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": float(lp), "rank": r, "decoded_token": text(int(t))}
            for r, (t, lp) in enumerate(e[1], 1)
        }
        entry.setdefault(str(tid), {"logprob": float(e[0]), "decoded_token": text(tid)})
        out.append(entry)
    return orjson.Fragment(orjson.dumps(out))


def prompt_token_logprobs(gen: Generation) -> list[TokenLogprob] | None:
    """The prompt's logprobs as tokens' text (for `echo`); a table of prompt tokens x
    (top N + 1) entries: call it off the event loop."""
    entries = gen.prompt_logprobs_raw
    if entries is None:
        return None
    text = gen.svc.codec.token_text
    return [
        TokenLogprob(text(tid), None, [])
        if e is None
        else TokenLogprob(text(tid), float(e[0]), [(text(int(t)), float(tlp)) for t, tlp in e[1]])
        for tid, e in zip(gen.prompt_ids_for_logprobs, entries, strict=False)
    ]


class _PromptTables:
    """One prompt's logprob tables, each rendered once (off the loop: `build`) when the
    engine's first event brings them, then reused by every chunk and choice."""

    __slots__ = ("echo", "vllm")

    def __init__(self) -> None:
        self.vllm: orjson.Fragment | None = None  # vLLM's `prompt_logprobs`
        self.echo: EchoTable | None = None  # OpenAI's, before an echoed answer

    def ready(self, gen: Generation) -> bool:
        return gen.prompt_logprobs_raw is None or self.vllm is not None

    def build(self, gen: Generation, vllm: bool, echo: bool) -> None:
        if gen.prompt_logprobs_raw is None or self.vllm is not None:
            return
        lps = prompt_token_logprobs(gen) if echo else None
        self.echo = EchoTable.of(lps) if lps is not None else None
        self.vllm = _vllm_prompt_logprobs(gen) if vllm else orjson.Fragment(b"null")


class AnswerView:
    """Renders one request's deltas in the shape of its API (chat or completions)."""

    def __init__(
        self, gen: Generation, model: str, chat: bool, echo: str | None = None, prompt_logprobs: bool = False
    ) -> None:
        self.gen = gen
        self.chat = chat
        self.echo = echo  # completions with `echo`: the prompt's text, sent before each choice's answer
        self.vllm_prompt_logprobs = prompt_logprobs  # vLLM's `prompt_logprobs` field asked for
        self.head = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.context.created or int(time.time()),
            "model": model,
        }
        self.offsets = [0] * len(gen.choices)  # characters sent per choice (text_offset)
        self.started: set[int] = set()  # chat: choices whose role was sent
        self.first_index = 0  # in a batch of prompts: this prompt's index * n
        self.tables = _PromptTables()
        self.table_sent = False  # streamed: vLLM's table goes out once, in the first chunk after it came

    @property
    def finished(self) -> bool:
        return self.gen.finished

    @property
    def replayable(self) -> bool:
        """Each delta is an event of its own (numbered the same on any gateway)."""
        return self.gen.replayable

    @property
    def usage(self) -> Usage:
        return self.gen.usage

    async def next_choices(self, timeout: float) -> list[dict[str, Any]] | None:
        """The chunk choices of the next deltas; None when `timeout` passed first."""
        deltas = await self.gen.next(timeout=timeout)
        return None if not deltas else await self.render(deltas)

    async def render(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The chunk choices of `deltas`, the prompt's tables built first (off the loop:
        a long prompt's table is megabytes of JSON)."""
        if not self.tables.ready(self.gen):
            await textwork.run(self.build_tables)
        return self.choices_of(deltas)

    def build_tables(self) -> None:
        want_echo = self.echo is not None and self.gen.want_logprobs
        self.tables.build(self.gen, self.vllm_prompt_logprobs, want_echo)

    def choices_of(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        return [
            self.chunk_choice(d)
            for d in deltas
            if d.text or d.finish_reason or d.logprobs or d.reasoning or d.tool_calls
        ]

    def chunk_choice(self, d: Delta) -> dict[str, Any]:
        if self.chat:
            other = d.finish_reason or d.reasoning or d.tool_calls
            delta: dict[str, Any] = {"content": d.text} if d.text or not other else {}
            if d.index not in self.started:
                self.started.add(d.index)
                delta = {"role": "assistant", "content": d.text}
            delta |= chat_extras(d.reasoning, d.tool_calls)
            out = {"index": d.index, "delta": delta, "logprobs": _chat_logprobs(d.logprobs)}
        else:
            text, head = d.text, None
            if d.index not in self.started:
                self.started.add(d.index)
                text, head = self.echoed(text, d.logprobs)
            out = {
                "index": d.index,
                "text": text,
                "logprobs": _completion_logprobs(d.logprobs, self.offsets[d.index], head),
            }
            if self.vllm_prompt_logprobs and d.index == 0 and not self.table_sent:
                self.build_tables()  # a no-op when render() built them
                out["prompt_logprobs"] = self.tables.vllm
                self.table_sent = self.tables.vllm is not None
            self.offsets[d.index] += len(text)
            out["finish_reason"] = d.finish_reason
            out["index"] = d.index + self.first_index
            return out
        self.offsets[d.index] += len(d.text)
        out["finish_reason"] = d.finish_reason
        return out

    def echoed(self, text: str, lps: list[TokenLogprob] | None) -> tuple[str, EchoTable | None]:
        """A choice's first text with the prompt's before it, for `echo`, and the prompt's
        logprobs (rendered once) to head its own when it has them."""
        if self.echo is None:
            return text, None
        if lps is not None:
            self.build_tables()  # a no-op when render() built them
        return self.echo + text, self.tables.echo if lps is not None else None


def _total(gens: list[Generation]) -> Usage:
    us = [g.usage for g in gens]
    return Usage(
        sum(u.prompt_tokens for u in us),
        sum(u.completion_tokens for u in us),
        sum(u.cached_tokens for u in us),
        sum(u.drafted_tokens for u in us),
        sum(u.accepted_tokens for u in us),
    )


class BatchView:
    """A list of prompts in one /v1/completions call: one request per prompt, their
    choices numbered prompt's index * n + choice, their usage summed."""

    def __init__(self, apis: list[AnswerView]) -> None:
        self.apis = apis
        self.head = apis[0].head
        n = len(apis[0].gen.choices)
        for i, a in enumerate(apis):
            a.head, a.first_index = self.head, i * n
        self._pending: dict[int, asyncio.Future[list[Delta]]] = {}

    @property
    def finished(self) -> bool:
        return all(a.gen.finished for a in self.apis)

    replayable = False  # a list of prompts is not resumable

    @property
    def usage(self) -> Usage:
        return _total([a.gen for a in self.apis])

    async def next_choices(self, timeout: float) -> list[dict[str, Any]] | None:
        for i, a in enumerate(self.apis):
            if i not in self._pending and not a.gen.finished:
                self._pending[i] = asyncio.ensure_future(a.gen.next(timeout=timeout))
        if not self._pending:
            return []
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        ready = [i for i in sorted(self._pending) if self._pending[i].done()]
        got = [(i, self._pending.pop(i).result()) for i in ready]  # raises GenerationError
        if not any(deltas for _, deltas in got):
            return None  # every one that answered timed out
        return [c for i, deltas in got for c in await self.apis[i].render(deltas)]

    async def close(self) -> None:
        """However the call ends: stop waiting, and free what still runs."""
        for f in self._pending.values():
            f.cancel()
        for f in self._pending.values():
            with contextlib.suppress(BaseException):
                await f
        self._pending.clear()
        for a in self.apis:
            await a.gen.cancel()


def _choices(api: AnswerView, per_choice: list[list[Delta]]) -> list[dict[str, Any]]:
    gen = api.gen
    choices = []
    for i, deltas in enumerate(per_choice):
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in (d.logprobs or [])] if gen.want_logprobs else None
        finish = deltas[-1].finish_reason if deltas else None
        if api.chat:
            calls = assemble_tool_calls([c for d in deltas for c in d.tool_calls or []])
            reasoning = "".join(d.reasoning for d in deltas)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text or (None if calls else text)}
                    | chat_extras(reasoning, calls),
                    "logprobs": _chat_logprobs(lps),
                    "finish_reason": finish,
                }
            )
        else:
            text, head = api.echoed(text, lps)
            choice = {
                "index": api.first_index + i,
                "text": text,
                "logprobs": _completion_logprobs(lps, 0, head),
                "finish_reason": finish,
            }
            if api.vllm_prompt_logprobs:  # the prompt's table: built once, on its first choice
                api.build_tables()
                choice["prompt_logprobs"] = api.tables.vllm if i == 0 else None
            choices.append(choice)
    return choices


def whole_answer(views: list[AnswerView], collected: list[list[list[Delta]]]) -> dict[str, Any]:
    """The response body of one request, or of a batch of prompts (a view each), from
    the deltas of each of its choices. Its prompt tables can be megabytes: call it (and
    serialize its result) off the event loop when they were asked for."""
    choices = [c for v, per_choice in zip(views, collected, strict=True) for c in _choices(v, per_choice)]
    obj = "chat.completion" if views[0].chat else "text_completion"
    usage = usage_json(_total([v.gen for v in views]))
    return views[0].head | {"object": obj, "choices": choices, "usage": usage}


def prompt_text(gen: Generation, req: CompletionRequest) -> str:
    """The prompt as the client gave it: its text, or its token ids decoded."""
    prompt = req.single
    if isinstance(prompt, str):
        return prompt
    return gen.svc.codec.decode(prompt)
