"""What the first structured-output request costs the other streams: a plain stream of
`wsllm serve` (SmolLM2) runs, a regex-constrained request arrives a second later, and
the plain stream's largest gap between two chunks is measured (and the structured
request's latency). The first structured request needs llguidance's index of the
tokenizer; by default the first structured request has it built (on the matchers' thread:
100+ MB that a server nobody asks for structured output never holds), and with
`--structured-index-at-start` the server builds it when the model is loaded. Compare the
two with the variable:

    .venv/bin/python bench/structured_first_request.py
    WSLLM_STRUCTURED_INDEX_AT_START=1 .venv/bin/python bench/structured_first_request.py
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def measure(url: str) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=120) as c:
        for _ in range(600):
            try:
                if (await c.get(url + "/ready")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        await asyncio.sleep(6)  # the warm-up build (about a second) is long done
        gaps: list[float] = []

        async def plain() -> None:
            last = None
            body = {"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
            async with c.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        async def structured() -> float:
            await asyncio.sleep(1.0)
            t = time.perf_counter()
            regex = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
            body = {"prompt": "A date:", "max_tokens": 12, "structured_outputs": {"regex": regex}}
            (await c.post(url + "/v1/completions", json=body)).raise_for_status()
            return time.perf_counter() - t

        _, latency = await asyncio.gather(plain(), structured())
    gaps.sort()
    return {
        "plain_stream_max_gap_s": round(gaps[-1], 3),
        "plain_stream_p50_gap_s": round(gaps[len(gaps) // 2], 4),
        "first_structured_latency_s": round(latency, 3),
    }


def main() -> int:
    port = free_port()
    exe = Path(sys.executable).parent / "wsllm"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [str(exe), "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        print(json.dumps(asyncio.run(measure(f"http://127.0.0.1:{port}"))))
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
