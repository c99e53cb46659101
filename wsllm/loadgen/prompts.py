"""What the load generator sends: synthetic prompts of a given length, or prompts
read from a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common short English words: in BPE vocabularies each " word" is one token, so a
# prompt of N words is about N tokens when no tokenizer is given.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there can all we one so up out if about who get make go when me would my "
    "time no just him know take people into year your good some could them see other than then now look "
    "only come its over think also back after use two how our work first well way even new want because "
    "any these give day most us red blue tree river city house water light small great old long little"
)
WORDS = tuple(_WORDS.split())


@dataclass(slots=True)
class Prompt:
    """One request's input: `prompt` for completions, `messages` for chat (either is
    made from the other when the endpoint asks for it)."""

    text: str
    messages: list[dict[str, Any]] | None
    input_len: int  # tokens, as the client estimates them (the server's usage wins)
    max_tokens: int

    def for_chat(self) -> list[dict[str, Any]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text}]

    def for_completion(self) -> str:
        if self.messages is None:
            return self.text
        return "\n".join(str(m.get("content", "")) for m in self.messages)


class _Tokenizer:
    """`tokenizers` (no torch, no transformers) on a directory's tokenizer.json."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        self.tok = Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def synthetic(n: int, input_len: int, output_len: int, tokenizer: str | None, seed: int) -> list[Prompt]:
    """`n` distinct random-word prompts (distinct from the first word on, so that a
    prefix cache does not flatter the server). With a tokenizer, each prompt is cut to
    exactly `input_len` tokens; without one, `input_len` words."""
    rng = random.Random(seed)
    tok = _Tokenizer(tokenizer) if tokenizer else None
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(input_len)]
        text = " ".join(words)
        length = input_len
        if tok is not None:
            ids = tok.encode(text)
            while len(ids) < input_len:
                ids += tok.encode(" " + rng.choice(WORDS))
            text = tok.decode(ids[:input_len])
            length = len(tok.encode(text))  # decode-encode may merge at the cut
        out.append(Prompt(text, None, length, output_len))
    return out


def from_jsonl(path: str, n: int, output_len: int, tokenizer: str | None) -> list[Prompt]:
    """One prompt per line: {"prompt": str} or {"messages": [...]}, with an optional
    "max_tokens" (else `output_len`). Lines are reused in order when `n` exceeds them."""
    tok = _Tokenizer(tokenizer) if tokenizer else None
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
        ):
            raise ValueError(f'{path}:{lineno}: expected {{"prompt": str}} or {{"messages": [...]}}')
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        messages = row.get("messages")
        text = row["prompt"] if isinstance(row.get("prompt"), str) else ""
        p = Prompt(text, messages, 0, int(row.get("max_tokens", output_len)))
        body = p.for_completion()
        p.input_len = len(tok.encode(body)) if tok is not None else len(body.split())
        out.append(p)
    return out
