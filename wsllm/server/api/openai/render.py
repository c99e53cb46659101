"""OpenAI's shapes of one request's answer: stream chunks and whole responses of
/v1/chat/completions and /v1/completions, with usage, `echo`, vLLM's extensions (the
`prompt_logprobs` table, `token_ids`, usage in every chunk: `Shape`) and a batch of
prompts answered as one. A stream sends one choice a chunk, named by its `index`. Their
logprobs are logprobs.py's; the routes that send them are routes.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from wsllm.server import textwork
from wsllm.server.api.openai.logprobs import EchoTable, PromptTables, chat_logprobs, completion_logprobs
from wsllm.server.chat.output import assemble_tool_calls
from wsllm.server.delta import Delta, TokenLogprob
from wsllm.server.generation import Generation
from wsllm.server.schemas import ChatRequest, CompletionRequest
from wsllm.server.text import TextCodec
from wsllm.types import Usage

#: `Shape.extras` names, as ResumeContext.extras stores them
TOKEN_IDS, CONTINUOUS_USAGE = "token_ids", "continuous_usage"


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


@dataclass(frozen=True, slots=True)
class Shape:
    """What a request asked of its answer beyond OpenAI's defaults."""

    #: text before each choice's answer: a completion's prompt, or a chat's last (assistant) message
    echo: str | None = None
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` table
    token_ids: bool = False  # vLLM's `return_token_ids`: `prompt_token_ids` and each choice's `token_ids`
    prompt_ids: list[int] | None = None  # with token_ids: the prompt's (None on a resume: not kept)
    include_usage: bool = False  # streamed: a last chunk with the usage
    continuous_usage: bool = False  # streamed: the usage so far in every chunk (vLLM's)

    @classmethod
    def of(cls, req: ChatRequest | CompletionRequest, prompt_ids: list[int], echo: str | None) -> Shape:
        return cls(
            echo,
            req.prompt_logprobs is not None,
            bool(req.return_token_ids),
            prompt_ids if req.return_token_ids else None,
            req.include_usage,
            req.continuous_usage,
        )

    @classmethod
    def resumed(cls, include_usage: bool, extras: list[str]) -> Shape:
        """A resumed stream's (ResumeContext.extras); the prompt's ids are not kept there."""
        return cls(None, False, TOKEN_IDS in extras, None, include_usage, CONTINUOUS_USAGE in extras)

    @property
    def extras(self) -> list[str]:
        return [n for n, on in ((TOKEN_IDS, self.token_ids), (CONTINUOUS_USAGE, self.continuous_usage)) if on]


class AnswerView:
    """Renders one request's deltas in the shape of its API (chat or completions)."""

    def __init__(self, gen: Generation, model: str, chat: bool, shape: Shape | None = None) -> None:
        self.gen = gen
        self.chat = chat
        self.shape = shape or Shape()
        self.head: dict[str, Any] = {
            "id": gen.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.context.created or int(time.time()),
            "model": model,
        }
        self.offsets = [0] * len(gen.choices)  # characters sent per choice (text_offset)
        self.started: set[int] = set()  # choices whose first chunk was sent (role, echo, prompt ids)
        self.first_index = 0  # in a batch of prompts: this prompt's index * n
        self.tables = PromptTables()
        self.table_sent = False  # streamed: vLLM's table goes out once, in the first chunk after it came
        self.sent_tokens = 0  # completion tokens rendered so far (the usage in every chunk)
        self.usage_now = self.usage_so_far  # a batch of prompts sums its prompts' instead

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

    def usage_so_far(self) -> Usage:
        return Usage(self.gen.prompt_len, self.sent_tokens, self.gen.cached_tokens)

    async def next_chunks(self, timeout: float) -> list[dict[str, Any]] | None:
        """The stream chunks of the next deltas; None when `timeout` passed first."""
        deltas = await self.gen.next(timeout=timeout)
        return None if not deltas else await self.render(deltas)

    async def render(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The stream chunks of `deltas`, one choice each, the prompt's tables built first
        (off the loop: a long prompt's table is megabytes of JSON)."""
        if not self.tables.ready(self.gen):
            await textwork.run(self.build_tables)
        return [
            self.chunk(d)
            for d in deltas
            if d.text or d.finish_reason or d.logprobs or d.reasoning or d.tool_calls
        ]

    def build_tables(self) -> None:
        want_echo = self.echo is not None and self.gen.want_logprobs
        self.tables.build(self.gen, self.shape.prompt_logprobs, want_echo)

    @property
    def echo(self) -> str | None:
        return self.shape.echo

    def chunk(self, d: Delta) -> dict[str, Any]:
        """The stream chunk of one delta (one choice): with vLLM's `prompt_token_ids` in a
        chat's first (the response's) or each completion choice's first (the choice's), and
        the usage (null, or the usage so far) with `stream_options`."""
        first = d.index not in self.started
        self.started.add(d.index)
        self.sent_tokens += d.num_tokens
        s = self.shape
        choice = self.chat_choice(d, first) if self.chat else self.completion_choice(d, first)
        if s.token_ids:
            choice["token_ids"] = d.token_ids
        out: dict[str, Any] = self.head | {"choices": [choice]}
        if s.prompt_ids is not None and first and (not self.chat or len(self.started) == 1):
            (out if self.chat else choice)["prompt_token_ids"] = s.prompt_ids
        if s.include_usage:
            out["usage"] = usage_json(self.usage_now()) if s.continuous_usage else None
        return out

    def chat_choice(self, d: Delta, first: bool) -> dict[str, Any]:
        other = d.finish_reason or d.reasoning or d.tool_calls
        delta: dict[str, Any] = {"content": d.text} if d.text or not other else {}
        if first:
            delta = {"role": "assistant", "content": (self.echo or "") + d.text}
        delta |= chat_extras(d.reasoning, d.tool_calls)
        self.offsets[d.index] += len(d.text)
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": chat_logprobs(d.logprobs),
            "finish_reason": d.finish_reason,
        }

    def completion_choice(self, d: Delta, first: bool) -> dict[str, Any]:
        text, head = self.echoed(d.text, d.logprobs) if first else (d.text, None)
        out = {
            "index": d.index + self.first_index,
            "text": text,
            "logprobs": completion_logprobs(d.logprobs, self.offsets[d.index], head),
        }
        if self.shape.prompt_logprobs and d.index == 0 and not self.table_sent:
            self.build_tables()  # a no-op when render() built them
            out["prompt_logprobs"] = self.tables.vllm
            self.table_sent = self.tables.vllm is not None
        self.offsets[d.index] += len(text)
        out["finish_reason"] = d.finish_reason
        return out

    def echoed(self, text: str, lps: list[TokenLogprob] | None) -> tuple[str, EchoTable | None]:
        """A completion choice's first text with the prompt's before it, for `echo`, and the
        prompt's logprobs (rendered once) to head its own when it has them."""
        if self.echo is None:
            return text, None
        if lps is not None:
            self.build_tables()  # a no-op when render() built them
        return self.echo + text, self.tables.echo if lps is not None else None


def _total(us: list[Usage]) -> Usage:
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
            a.head, a.first_index, a.usage_now = self.head, i * n, self.usage_so_far
        self._pending: dict[int, asyncio.Future[list[Delta]]] = {}

    @property
    def finished(self) -> bool:
        return all(a.gen.finished for a in self.apis)

    replayable = False  # a list of prompts is not resumable

    @property
    def shape(self) -> Shape:
        return self.apis[0].shape

    @property
    def usage(self) -> Usage:
        return _total([a.gen.usage for a in self.apis])

    def usage_so_far(self) -> Usage:
        return _total([a.usage_so_far() for a in self.apis])

    async def next_chunks(self, timeout: float) -> list[dict[str, Any]] | None:
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
    gen, s = api.gen, api.shape
    choices = []
    for i, deltas in enumerate(per_choice):
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in (d.logprobs or [])] if gen.want_logprobs else None
        finish = deltas[-1].finish_reason if deltas else None
        ids = {"token_ids": [t for d in deltas for t in d.token_ids]} if s.token_ids else {}
        if api.chat:
            calls = assemble_tool_calls([c for d in deltas for c in d.tool_calls or []])
            reasoning = "".join(d.reasoning for d in deltas)
            text = (api.echo or "") + text
            message = {"role": "assistant", "content": text or (None if calls else text)}
            choice = {"index": i, "message": message | chat_extras(reasoning, calls)}
            choices.append(choice | {"logprobs": chat_logprobs(lps), "finish_reason": finish} | ids)
            continue
        text, head = api.echoed(text, lps)
        choice = {
            "index": api.first_index + i,
            "text": text,
            "logprobs": completion_logprobs(lps, 0, head),
            "finish_reason": finish,
        }
        if s.prompt_logprobs:  # the prompt's table: built once, on its first choice
            api.build_tables()
            choice["prompt_logprobs"] = api.tables.vllm if i == 0 else None
        if s.prompt_ids is not None:
            choice["prompt_token_ids"] = s.prompt_ids
        choices.append(choice | ids)
    return choices


def whole_answer(views: list[AnswerView], collected: list[list[list[Delta]]]) -> dict[str, Any]:
    """The response body of one request, or of a batch of prompts (a view each), from
    the deltas of each of its choices. Its prompt tables can be megabytes: call it (and
    serialize its result) off the event loop when they were asked for."""
    choices = [c for v, per_choice in zip(views, collected, strict=True) for c in _choices(v, per_choice)]
    first = views[0]
    usage = usage_json(_total([v.gen.usage for v in views]))
    out: dict[str, Any] = first.head | {"object": "chat.completion" if first.chat else "text_completion"}
    out["choices"] = choices
    out["usage"] = usage
    if first.chat and first.shape.prompt_logprobs:  # vLLM's: a chat's table is the response's
        first.build_tables()
        out["prompt_logprobs"] = first.tables.vllm
    if first.chat and first.shape.prompt_ids is not None:
        out["prompt_token_ids"] = first.shape.prompt_ids
    return out


def echo_text(codec: TextCodec, req: ChatRequest | CompletionRequest, prompt_ids: list[int]) -> str | None:
    """What `echo` puts before each choice's answer: a chat's last message when it is the
    assistant's; a completion's prompt as the client gave it (its text, or its token ids
    decoded), or what the model read of it when `truncate_prompt_tokens` cut it."""
    if isinstance(req, ChatRequest):
        return req.echoed
    if not req.echo:
        return None
    if req.truncate_prompt_tokens is not None:
        return codec.decode(prompt_ids)
    prompt = req.single
    return prompt if isinstance(prompt, str) else codec.decode(prompt)
