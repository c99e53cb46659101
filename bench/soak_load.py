"""The soak's workload (bench/soak.py): one request of each kind a client sends, each
ending in an `Outcome` that says how it ended, whatever happened to the server.

Kinds: chat streamed (SSE), completions, responses (some stored), Anthropic messages,
embeddings, structured output (a JSON schema), n > 1, beam search, streams cancelled
after a few chunks, WebSocket clients that leave mid-stream, and WebSocket resumes (read
a few deltas, drop the socket, resume on a new one with the resume token and `after_seq`).

An end is one of: `done` (the whole answer, or a cancel the client asked for), a clear
error (an OpenAI/Anthropic error body or an `error` event, with its code: 429 and 503
are the server saying no under overload or a fault), or a failure: `hung` (no end
within the request's deadline) and `broken` (the connection broke, or an answer that is
not what the protocol says)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import websockets

CANCELLED = "cancelled"  # the client left on purpose: an end it asked for
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "cats",
    "watch",
    "it",
    "go",
    "by",
]


@dataclass(slots=True)
class Outcome:
    kind: str
    end: str  # "done", "cancelled", "error:<code>", "hung", "broken:<why>"
    admitted: bool  # the server took it (a 200, a WebSocket `started`)
    start: float  # time.monotonic()
    stop: float

    @property
    def failed(self) -> bool:
        return self.end == "hung" or self.end.startswith("broken") or self.end == "error:internal_error"


class ClearError(Exception):
    """The server answered with an error in its protocol's shape."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _check(r: httpx.Response) -> dict[str, Any]:
    """The JSON answer of a 200, or ClearError for an error body; anything else is broken."""
    body = orjson.loads(r.content)
    if r.status_code != 200:
        err = body.get("error") if isinstance(body, dict) else None
        code = err.get("code") or err.get("type") if isinstance(err, dict) else None
        if not code:
            raise ValueError(f"status {r.status_code} without an error body: {r.text[:200]}")
        raise ClearError(str(code))
    return dict(body)


class Load:
    """The client side of the soak: `one(kind)` runs one request to its end."""

    def __init__(self, base: str, model: str, keys: list[str], deadline_s: float, seed: int = 0) -> None:
        self.base, self.model, self.keys, self.deadline_s = base, model, keys, deadline_s
        self.rng = random.Random(seed)
        self.http = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(deadline_s, connect=10))
        self.kinds: dict[str, Callable[[str], Awaitable[bool]]] = {
            "chat_stream": self.chat_stream,
            "completion": self.completion,
            "responses": self.responses,
            "messages": self.messages,
            "embeddings": self.embeddings,
            "structured": self.structured,
            "n_choices": self.n_choices,
            "beam": self.beam,
            "cancel_stream": self.cancel_stream,
            "ws_leave": self.ws_leave,
            "ws_resume": self.ws_resume,
        }

    async def aclose(self) -> None:
        await self.http.aclose()

    def _headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}", "x-api-key": key}

    async def one(self, kind: str) -> Outcome:
        """Run one request of `kind` to its end, within its deadline."""
        key = self.rng.choice(self.keys)
        start = time.monotonic()
        admitted = [False]

        async def run() -> bool:
            admitted[0] = await self.kinds[kind](key)
            return admitted[0]

        try:
            async with asyncio.timeout(self.deadline_s):
                ok = await run()
            end = "done" if ok else CANCELLED
        except ClearError as e:
            end = f"error:{e.code}"
        except TimeoutError:
            end = "hung"
        except Exception as e:  # noqa: BLE001 - a broken end is what the soak counts
            end = f"broken:{type(e).__name__}: {str(e)[:120]}"
        return Outcome(kind, end, admitted[0] or end in ("done", CANCELLED), start, time.monotonic())

    # -- HTTP kinds (True: the whole answer) ----------------------------------------------

    async def _post(self, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
        return _check(await self.http.post(path, json=body, headers=self._headers(key)))

    async def _sse(self, path: str, key: str, body: dict[str, Any], stop_after: int | None = None) -> bool:
        """A streamed answer read to `[DONE]` (True), or left after `stop_after` chunks."""
        chunks = 0
        async with self.http.stream(
            "POST", path, json=body | {"stream": True}, headers=self._headers(key)
        ) as r:
            if r.status_code != 200:
                _check(httpx.Response(r.status_code, content=await r.aread()))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return True
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        raise ClearError(str(chunk["error"].get("code")))
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        return False
        raise ValueError("the stream ended without [DONE]")

    def _chat(self, n_words: int, max_tokens: int) -> dict[str, Any]:
        msg = {"role": "user", "content": text(self.rng, n_words)}
        return {"model": self.model, "messages": [msg], "max_tokens": max_tokens}

    async def chat_stream(self, key: str) -> bool:
        return await self._sse("/v1/chat/completions", key, self._chat(12, 32))

    async def completion(self, key: str) -> bool:
        body = {"model": self.model, "prompt": text(self.rng, 16), "max_tokens": 24}
        return bool((await self._post("/v1/completions", key, body))["choices"])

    async def responses(self, key: str) -> bool:
        body = {"model": self.model, "input": text(self.rng, 12), "max_output_tokens": 24}
        answer = await self._post("/v1/responses", key, body | {"store": self.rng.random() < 0.25})
        if answer["status"] not in ("completed", "incomplete"):
            raise ValueError(f"a response {answer['status']}")
        return True

    async def messages(self, key: str) -> bool:
        body = {
            "model": self.model,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": text(self.rng, 10)}],
        }
        return (await self._post("/v1/messages", key, body))["type"] == "message"

    async def embeddings(self, key: str) -> bool:
        body = {"model": self.model, "input": [text(self.rng, 8), text(self.rng, 20)]}
        return len((await self._post("/v1/embeddings", key, body))["data"]) == 2

    async def structured(self, key: str) -> bool:
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                  "n": {"type": "integer"}}, "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
        return bool(
            (await self._post("/v1/chat/completions", key, self._chat(8, 40) | {"response_format": fmt}))[
                "choices"
            ]
        )

    async def n_choices(self, key: str) -> bool:
        body = {"model": self.model, "prompt": text(self.rng, 10), "max_tokens": 16, "n": 3, "seed": 7}
        return len((await self._post("/v1/completions", key, body))["choices"]) == 3

    async def beam(self, key: str) -> bool:
        body = {"model": self.model, "prompt": text(self.rng, 10), "max_tokens": 12, "n": 2,
                "use_beam_search": True, "beam_width": 3}  # fmt: skip
        return len((await self._post("/v1/completions", key, body))["choices"]) == 2

    async def cancel_stream(self, key: str) -> bool:
        body = {"model": self.model, "prompt": text(self.rng, 10), "max_tokens": 200, "ignore_eos": True}
        await self._sse("/v1/completions", key, body, stop_after=3)
        return False  # it left after 3 chunks, as it meant to

    # -- WebSocket kinds ------------------------------------------------------------------

    def _ws(self, key: str) -> Any:
        url = self.base.replace("http", "ws", 1) + "/v1/ws"
        return websockets.connect(url, additional_headers={"authorization": f"Bearer {key}"}, open_timeout=30)

    @staticmethod
    async def _until(ws: Any, rid: str, stop: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Messages of request `rid` until `stop(msg)`; ClearError for its `error`."""
        while True:
            msg = orjson.loads(await ws.recv())
            if msg.get("id") != rid:
                continue
            if msg["type"] == "error":
                raise ClearError(str(msg.get("code")))
            if stop(msg):
                return dict(msg)

    async def ws_leave(self, key: str) -> bool:
        """A client that leaves mid-stream (its request runs on for a resume, then ends)."""
        async with self._ws(key) as ws:
            await ws.recv()  # hello
            msg = {"type": "chat", "id": "a", "model": self.model, "max_tokens": 200, "ignore_eos": True,
                   "messages": [{"role": "user", "content": text(self.rng, 8)}]}  # fmt: skip
            await ws.send(orjson.dumps(msg).decode())
            await self._until(ws, "a", lambda m: m["type"] == "delta")
        return False

    async def ws_resume(self, key: str) -> bool:
        """Read a few deltas, drop the socket, resume on a new one: the rest must come,
        numbered after what was read (`seq`), and end."""
        body = {"type": "completion", "id": "r", "model": self.model, "prompt": text(self.rng, 8),
                "max_tokens": 40, "ignore_eos": True}  # fmt: skip
        async with self._ws(key) as ws:
            await ws.recv()
            await ws.send(orjson.dumps(body).decode())
            token = (await self._until(ws, "r", lambda m: m["type"] == "started"))["resume_token"]
            after = -1
            for _ in range(3):
                m = await self._until(ws, "r", lambda m: m["type"] in ("delta", "done"))
                if m["type"] == "done":
                    return True
                after = m["seq"]
        resume = {"type": "resume", "id": "r2", "after_seq": after, "resume_token": token}
        async with self._ws(key) as ws:
            await ws.recv()
            await ws.send(orjson.dumps(resume).decode())
            while (m := await self._until(ws, "r2", lambda m: m["type"] in ("delta", "done")))[
                "type"
            ] == "delta":
                if m["seq"] <= after:
                    raise ValueError(f"the resume repeated seq {m['seq']} (after {after})")
                after = m["seq"]
        return m["finish_reason"] in ("length", "stop")
