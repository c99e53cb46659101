"""OpenAI's logprob shapes of an answer's tokens (chat's `content` list, completions'
parallel lists) and vLLM's `prompt_logprobs` table, with the echoed prompt's logprobs of
a completion; each prompt table rendered once per prompt, off the event loop
(`PromptTables`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from wsllm.server.delta import TokenLogprob
from wsllm.server.generation import Generation


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: each token with its top N (OpenAI's `content` list)."""
    if lps is None:
        return None

    def entry(token: str, lp: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {
        "content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]} for t in lps]
    }


def completion_logprobs(
    lps: list[TokenLogprob] | None, offset: int, head: EchoTable | None = None
) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of `lps`, their text starting at `offset`; `head`:
    the echoed prompt's, rendered once, before them."""
    if lps is None:
        return None
    out = EchoTable.of(lps, offset + (head.chars if head is not None else 0)).lists
    return out if head is None else {k: head.lists[k] + v for k, v in out.items()}


def _top(t: TokenLogprob) -> dict[str, float] | None:
    """A token's `top_logprobs` entry in OpenAI's legacy completions: the top N and the
    token itself (N + 1 entries when it is not among them; `logprobs: 0` gives it alone)."""
    if t.logprob is None:  # a prompt's first token: nothing came before to predict it
        return None
    top = dict(t.top)
    top.setdefault(t.token, t.logprob)
    return top


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
            "top_logprobs": [_top(t) for t in lps],
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
    text = gen.token_text
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
    text = gen.token_text
    return [
        TokenLogprob(text(tid), None, [])
        if e is None
        else TokenLogprob(text(tid), float(e[0]), [(text(int(t)), float(tlp)) for t, tlp in e[1]])
        for tid, e in zip(gen.prompt_ids_for_logprobs, entries, strict=False)
    ]


class PromptTables:
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
