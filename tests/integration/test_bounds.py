"""Each sampling bound is declared once (wsllm.bounds.SAMPLING_BOUNDS): changed there, it
changes the gateway's 400, the wire's own check (SamplingParams) and the range the
WebSocket hello announces to clients such as the chat UI (tests/e2e/test_ui_bounds.py
follows it into the settings dialog)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import websockets

from wsllm.bounds import SAMPLING_BOUNDS, Bound
from wsllm.types import GenerateRequest, SamplingParams, WireError
from wsllm.wire import decode_request, encode

# One bound changed in one place, before anything else reads it: a server started so.
NARROW = Bound(-0.5, 0.5)
PATCHED_SERVE = (
    "import sys; import wsllm.bounds as t; "
    "t.SAMPLING_BOUNDS['presence_penalty'] = t.Bound(-0.5, 0.5); "
    "from wsllm.cli import main; sys.exit(main())"
)


def patched_serve(model: Path, port: int) -> list[str]:
    """`wsllm serve` of `model` with presence_penalty's bound narrowed to NARROW."""
    return [sys.executable, "-c", PATCHED_SERVE, "serve", "--model", str(model), "--port", str(port),
            "--kv-cache-gb", "0.05", "--threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("bounds-server") / "server.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        patched_serve(tiny_model_dir, port), stdout=log, stderr=subprocess.STDOUT, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def chat(url: str, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_the_400_follows_the_declaration(server: str) -> None:
    r = chat(server, presence_penalty=0.75)  # inside the usual [-2, 2], outside NARROW
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "presence_penalty"
    assert chat(server, presence_penalty=0.5).status_code == 200
    assert chat(server, frequency_penalty=0.75).status_code == 200  # its neighbour kept its own


def test_the_hello_announces_the_declaration(server: str) -> None:
    async def hello() -> dict[str, Any]:
        async with websockets.connect(server.replace("http", "ws") + "/v1/ws") as ws:
            return orjson.loads(await asyncio.wait_for(ws.recv(), 30))  # type: ignore[no-any-return]

    bounds = asyncio.run(hello())["bounds"]
    assert bounds["presence_penalty"] == {"min": -0.5, "max": 0.5, "integer": False}
    assert bounds["frequency_penalty"] == {"min": -2.0, "max": 2.0, "integer": False}
    # a request's view: OpenAI's temperature range, top_k's -1 (off), the seed below 2^63
    assert bounds["temperature"]["max"] == 2.0
    assert bounds["top_k"]["min"] == -1
    assert bounds["seed"] == {"min": 0, "max": 2**63, "integer": True, "max_exclusive": True}
    assert set(bounds) == set(SAMPLING_BOUNDS)


def test_the_wire_check_follows_the_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = GenerateRequest("r1", [1, 2], SamplingParams(presence_penalty=0.75))
    monkeypatch.setitem(SAMPLING_BOUNDS, "presence_penalty", NARROW)
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-0.5, 0.5\]"):
        SamplingParams(presence_penalty=0.75)
    with pytest.raises(WireError, match="presence_penalty"):
        decode_request(encode(wide))  # an engine refuses what this gateway would not send
    assert SamplingParams(presence_penalty=0.5).presence_penalty == 0.5
