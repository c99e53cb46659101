"""Two clients with one job: send a prompt, stream the answer, time every content
chunk. `SSEClient` speaks only the OpenAI streaming API (any compatible server);
`WSClient` speaks wsllm's `/v1/ws`, many requests per socket (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from wsllm.loadgen import BenchConfig
from wsllm.loadgen.prompts import Prompt


@dataclass(slots=True)
class Result:
    """One request as the client saw it. Times are seconds from sending it."""

    ok: bool = False
    error: str = ""
    sent_at: float = 0.0  # perf_counter() when sent
    ttft: float = 0.0  # to the first chunk with text
    e2el: float = 0.0  # to the last chunk with choices (usage and [DONE] follow at once)
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks with text
    chunks: int = 0  # chunks with text
    output_tokens: int = 0  # the server's usage.completion_tokens, else `chunks`
    prompt_tokens: int = 0  # the server's usage.prompt_tokens, else the client's estimate
    usage_reported: bool = False


class Client(Protocol):
    async def send(self, prompt: Prompt) -> Result: ...
    async def close(self) -> None: ...


class _Timing:
    """Content arrivals of one request, vLLM's way: TTFT at the first chunk with text,
    an ITL gap between each later one."""

    def __init__(self, prompt: Prompt) -> None:
        self.r = Result(sent_at=time.perf_counter(), prompt_tokens=prompt.input_len)
        self.last = 0.0

    def chunk(self, text: str | None) -> None:
        now = time.perf_counter() - self.r.sent_at
        if text:
            if self.r.chunks == 0:
                self.r.ttft = now
            else:
                self.r.itl.append(now - self.last)
            self.last = now
            self.r.chunks += 1
        self.r.e2el = now

    def usage(self, usage: dict[str, Any]) -> None:
        self.r.output_tokens = int(usage.get("completion_tokens") or 0)
        self.r.prompt_tokens = int(usage.get("prompt_tokens") or self.r.prompt_tokens)
        self.r.usage_reported = True

    def finish(self, error: str = "") -> Result:
        r = self.r
        if not error and r.chunks == 0:
            error = "the stream ended without any text"
        r.ok, r.error = not error, error
        if not r.usage_reported:
            r.output_tokens = r.chunks
        return r


def request_body(cfg: BenchConfig, model: str | None, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": prompt.max_tokens, "temperature": cfg.temperature}
    if cfg.top_p < 1:
        body["top_p"] = cfg.top_p
    if cfg.top_k > 0:
        body["top_k"] = cfg.top_k  # an extension of vLLM's, llama-server's and wsllm's
    if model:
        body["model"] = model
    if cfg.endpoint == "chat":
        body["messages"] = prompt.for_chat()
    else:
        body["prompt"] = prompt.for_completion()
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def root_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def auth_headers(cfg: BenchConfig) -> dict[str, str]:
    return {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


class SSEClient:
    def __init__(self, cfg: BenchConfig, model: str | None, max_connections: int | None) -> None:
        self.cfg, self.model = cfg, model
        self.path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
        self.http = httpx.AsyncClient(
            base_url=root_url(cfg.base_url),
            headers=auth_headers(cfg),
            timeout=httpx.Timeout(cfg.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def send(self, prompt: Prompt) -> Result:
        body = request_body(self.cfg, self.model, prompt)
        body.update(stream=True, stream_options={"include_usage": True})
        t = _Timing(prompt)
        try:
            async with self.http.stream("POST", self.path, json=body) as resp:
                if resp.status_code != 200:
                    return t.finish(
                        f"HTTP {resp.status_code}: {_error_message((await resp.aread()).decode())}"
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # `id:` lines, `: keepalive` comments, blank separators
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return t.finish()
                    err = self._event(t, json.loads(data))
                    if err:
                        return t.finish(err)
            return t.finish("the stream ended without [DONE]")
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return t.finish(f"{type(e).__name__}: {e}")

    def _event(self, t: _Timing, event: dict[str, Any]) -> str:
        if event.get("error"):
            return f"stream error: {_error_message(json.dumps(event))}"
        if choices := event.get("choices"):
            c = choices[0]
            t.chunk((c.get("delta") or {}).get("content") if self.cfg.endpoint == "chat" else c.get("text"))
        if usage := event.get("usage"):
            t.usage(usage)
        return ""

    async def close(self) -> None:
        await self.http.aclose()


def _error_message(text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(text)["error"]
        return f"{err.get('code') or err.get('type')}: {err.get('message')}"
    return text[:200]


class _Socket:
    """One WebSocket and its reader, which routes messages by request id."""

    def __init__(self, ws: Any, limit: int) -> None:
        self.ws, self.limit = ws, limit
        self.live: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.closed = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                q = self.live.get(msg.get("id"))
                if q is not None:
                    q.put_nowait(msg)
        except Exception:  # a lost socket fails its live requests below
            pass
        finally:
            self.closed = True
            for q in self.live.values():
                q.put_nowait({"type": "error", "code": "socket_closed", "message": "the WebSocket closed"})


class WSClient:
    """Requests share sockets up to the server's `max_requests_per_socket` (from its
    `hello`); another socket opens when all are full."""

    def __init__(self, cfg: BenchConfig, model: str | None) -> None:
        self.cfg, self.model = cfg, model
        self.url = root_url(cfg.base_url).replace("http", "ws", 1) + "/v1/ws"
        self.sockets: list[_Socket] = []
        self.lock = asyncio.Lock()

    async def open(self, n_requests: int) -> None:
        """Open the sockets `n_requests` in flight need, before the clock starts."""
        await self._connect()
        while sum(s.limit for s in self.sockets) < n_requests:
            await self._connect()

    async def _connect(self) -> _Socket:
        from websockets.asyncio.client import connect

        ws = await connect(
            self.url, additional_headers=auth_headers(self.cfg), max_size=None, open_timeout=10
        )
        hello = json.loads(await ws.recv())
        if hello.get("type") != "hello":
            raise RuntimeError(f"{self.url}: expected hello, got {hello}")
        sock = _Socket(ws, int(hello.get("limits", {}).get("max_requests_per_socket", 1)))
        self.sockets.append(sock)
        return sock

    async def _slot(self, rid: str, q: asyncio.Queue[dict[str, Any]]) -> _Socket:
        async with self.lock:
            sock = next((s for s in self.sockets if not s.closed and len(s.live) < s.limit), None)
            if sock is None:
                sock = await self._connect()
            sock.live[rid] = q  # no await between the check and this: the slot is ours
            return sock

    async def send(self, prompt: Prompt) -> Result:
        rid = uuid.uuid4().hex[:12]
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        t = _Timing(prompt)
        try:
            sock = await self._slot(rid, q)
        except Exception as e:
            return t.finish(f"connect: {type(e).__name__}: {e}")
        msg = request_body(self.cfg, self.model, prompt)
        msg.update(type="chat" if self.cfg.endpoint == "chat" else "completion", id=rid)
        try:
            t.r.sent_at = time.perf_counter()
            await sock.ws.send(json.dumps(msg))
            while True:
                event = await asyncio.wait_for(q.get(), self.cfg.timeout_s)
                kind = event.get("type")
                if kind == "delta":
                    t.chunk(event.get("text"))
                elif kind == "done":
                    t.chunk(None)
                    if event.get("usage"):
                        t.usage(event["usage"])
                    return t.finish()
                elif kind == "error":
                    return t.finish(f"{event.get('code')}: {event.get('message')}")
        except Exception as e:  # a timeout, a closed socket
            return t.finish(f"{type(e).__name__}: {e}")
        finally:
            sock.live.pop(rid, None)

    async def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(Exception):
                await s.ws.close()
            s.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await s.reader
