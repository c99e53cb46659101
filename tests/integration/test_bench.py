"""`wsllm bench` against a live wsllm gateway (SSE and WS) and against a minimal
OpenAI-shaped SSE app that is not ours: its JSON has every figure, and the figures
agree with each other and with the server's own counters."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from wsllm.cli import build_parser
from wsllm.config import from_args
from wsllm.loadgen import BenchConfig
from wsllm.loadgen.runner import main

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def bench(tmp_path: Path, capsys: Any, cfg: BenchConfig | None = None, **kw: Any) -> dict[str, Any]:
    cfg = dataclasses.replace(cfg or BenchConfig(), json=str(tmp_path / "out.json"), **kw)
    assert main(cfg) == 0
    assert "TTFT p99 (ms)" in capsys.readouterr().out  # the table was printed
    return json.loads((tmp_path / "out.json").read_text())


def check_consistent(run: dict[str, Any], max_tokens: int) -> None:
    """What must hold in any run, whatever the server."""
    reqs = run["requests"]
    ok = [q for q in reqs if q["ok"]]
    assert (
        run["num_requests"] == len(reqs) and run["completed"] == len(ok) == len(reqs) and run["failed"] == 0
    )
    assert run["total_output_tokens"] == sum(q["output_tokens"] for q in ok)
    assert run["total_input_tokens"] == sum(q["prompt_tokens"] for q in ok)
    assert all(1 <= q["chunks"] <= q["output_tokens"] <= max_tokens for q in ok)
    d = run["duration_s"]
    assert run["request_throughput"] == pytest.approx(len(ok) / d)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / d)
    # The duration covers every request, and barely more than the last one's end.
    last_end = max(q["sent_s"] + q["e2el_ms"] / 1000 for q in ok)
    assert last_end <= d + 1e-6 and d - last_end < 0.5
    for q in ok:
        assert 0 < q["ttft_ms"] <= q["e2el_ms"]
        assert len(q["itl_ms"]) == q["chunks"] - 1
        # gaps between text chunks fit between the first text and the end
        assert sum(q["itl_ms"]) <= q["e2el_ms"] - q["ttft_ms"] + 1e-6
        if q["output_tokens"] > 1:
            expect = (q["e2el_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1)
            assert q["tpot_ms"] == pytest.approx(expect)
    counts = {
        "ttft_ms": len(ok),
        "e2el_ms": len(ok),
        "tpot_ms": sum(q["output_tokens"] > 1 for q in ok),
        "itl_ms": sum(q["chunks"] - 1 for q in ok),
    }
    for m in METRICS:
        s = run[m]
        assert s["count"] == counts[m], m
        if s["count"]:
            assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (m, s)
            assert s["min"] <= s["mean"] <= s["max"], (m, s)
    if run["concurrency"] is not None:  # never more requests in flight than asked
        events = sorted(
            [(q["sent_s"], 1) for q in ok] + [(q["sent_s"] + q["e2el_ms"] / 1000, -1) for q in ok]
        )
        live = peak = 0
        for _, step in events:
            live += step
            peak = max(peak, live)
        assert peak <= run["concurrency"]


# -- against wsllm ------------------------------------------------------------------------------


def test_bench_sse_two_levels_against_wsllm(
    tiny_server: Any, tiny_model_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    before = tiny_server.metric("wsllm_generation_tokens_total")
    out = bench(
        tmp_path,
        capsys,
        base_url=tiny_server.base_url,
        concurrency="1,4",
        num_requests=6,
        input_len=24,
        output_len=8,
        ignore_eos=True,
        tokenizer=str(tiny_model_dir),
        plot=str(tmp_path / "plots"),
    )
    assert out["model"] == tiny_server.gateway.model_name  # found through /v1/models
    assert [r["concurrency"] for r in out["runs"]] == [1, 4]
    for run in out["runs"]:
        check_consistent(run, max_tokens=8)
        assert run["usage_reported"] and run["total_output_tokens"] == 6 * 8  # ignore_eos: all 8
        assert run["total_input_tokens"] == 6 * 24  # cut to 24 tokens by the same tokenizer
    # The server counted what the client counted, plus one 4-token warm-up per level.
    deadline = time.monotonic() + 5
    while tiny_server.metric("wsllm_generation_tokens_total") - before < 2 * (6 * 8 + 4):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert tiny_server.metric("wsllm_generation_tokens_total") - before == 2 * (6 * 8 + 4)
    for name in ("latency_cdf.png", "throughput_vs_concurrency.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_ws_poisson_rate_against_wsllm(tiny_server: Any, tmp_path: Path, capsys: Any) -> None:
    out = bench(
        tmp_path,
        capsys,
        base_url=tiny_server.base_url + "/v1",
        transport="ws",
        endpoint="chat",
        request_rate=50.0,
        num_requests=8,
        input_len=8,
        output_len=6,
        ignore_eos=True,
    )
    (run,) = out["runs"]
    check_consistent(run, max_tokens=6)
    assert run["concurrency"] is None and run["request_rate"] == 50.0
    assert run["usage_reported"] and run["total_output_tokens"] == 8 * 6
    sent = [q["sent_s"] for q in run["requests"]]
    assert sent == sorted(sent) and sent[-1] > sent[0]  # arrivals spread out, in order
    assert run["total_input_tokens"] > 8 * 8  # the chat template adds its own tokens


# -- against an OpenAI-shaped app that is not ours ----------------------------------------------

FIRST_S, GAP_S = 0.05, 0.01


def third_party_app(seen: list[dict[str, Any]]) -> Starlette:
    """Streams one word per chunk like api.openai.com: a role-only first chat chunk, no
    `id:` lines, usage only when asked for (and never on /v1/completions, as some
    servers do), a keep-alive comment, and a bearer key."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "acme-1", "object": "model"}]})

    async def generate(request: Request) -> Any:
        if request.headers.get("authorization") != "Bearer sk-test":
            return JSONResponse(
                {"error": {"message": "bad key", "type": "auth", "code": "invalid_api_key"}}, 401
            )
        body = await request.json()
        seen.append(body)
        chat = request.url.path.endswith("/chat/completions")
        n = body["max_tokens"]
        usage = chat and (body.get("stream_options") or {}).get("include_usage")

        async def events() -> AsyncIterator[bytes]:
            def data(obj: Any) -> bytes:
                return b"data: " + json.dumps(obj).encode() + b"\n\n"

            if chat:
                yield data({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            await asyncio.sleep(FIRST_S)
            yield b": keep-alive\n\n"
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                piece = {"content": f" w{i}"} if chat else None
                choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                choice.update({"delta": piece} if chat else {"text": f" w{i}"})
                yield data({"id": "x", "object": "chunk", "model": "acme-1", "choices": [choice]})
            if usage:
                yield data(
                    {
                        "choices": [],
                        "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
                    }
                )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [
        Route("/v1/models", models),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
    ]
    return Starlette(routes=routes)


@pytest.fixture(scope="module")
def third_party() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(third_party_app(seen), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_bench_chat_with_jsonl_prompts_against_a_third_party_server(
    third_party: tuple[str, list[dict[str, Any]]], tmp_path: Path, capsys: Any
) -> None:
    url, seen = third_party
    lines = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]},
        {"prompt": "Once upon a time", "max_tokens": 3},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    seen.clear()
    args = build_parser().parse_args(
        ["bench", "--base-url", url, "--endpoint", "chat", "--prompts", str(tmp_path / "p.jsonl"),
         "--concurrency", "2", "--num-requests", "4", "--output-len", "5", "--api-key", "sk-test"]
    )  # fmt: skip
    out = bench(tmp_path, capsys, from_args(BenchConfig, args))
    (run,) = out["runs"]
    check_consistent(run, max_tokens=5)
    assert out["model"] == "acme-1" and out["config"]["api_key"] == "***"  # the key stays out of the file
    bodies = seen[1:]  # after the warm-up
    # Two requests are in flight at once, so the server may see them in either order.
    sent = sorted(json.dumps([b["messages"], b["max_tokens"]]) for b in bodies)
    expected = [[lines[0]["messages"], 5], [[{"role": "user", "content": "Once upon a time"}], 3]] * 2
    assert sent == sorted(json.dumps(x) for x in expected)
    assert all(b["model"] == "acme-1" and b["stream"] and "ignore_eos" not in b for b in bodies)
    assert run["usage_reported"] and run["total_output_tokens"] == 16 and run["total_input_tokens"] == 4 * 7
    # TTFT waits for the first text, not the role-only chunk; the clock only adds time.
    assert run["ttft_ms"]["min"] >= FIRST_S * 1000
    # (a single gap can look shorter than the server's: the client may read the earlier chunk late)
    for q in run["requests"]:
        assert q["e2el_ms"] >= (FIRST_S + (q["output_tokens"] - 1) * GAP_S) * 1000
    assert all(q["chunks"] == q["output_tokens"] for q in run["requests"])


def test_bench_counts_chunks_when_the_server_sends_no_usage(
    third_party: tuple[str, list[dict[str, Any]]], tmp_path: Path, capsys: Any
) -> None:
    url, _ = third_party
    out = bench(
        tmp_path, capsys, base_url=url + "/v1/", model="acme-1", api_key="sk-test",
        concurrency="3", num_requests=6, input_len=10, output_len=4,
    )  # fmt: skip
    (run,) = out["runs"]
    check_consistent(run, max_tokens=4)
    assert not run["usage_reported"]
    assert run["total_output_tokens"] == 6 * 4 and run["total_input_tokens"] == 6 * 10  # words, no tokenizer
    assert run["e2el_ms"]["min"] >= (FIRST_S + 3 * GAP_S) * 1000


def test_bench_fails_clearly_on_a_wrong_key(
    third_party: tuple[str, list[dict[str, Any]]], capsys: Any
) -> None:
    assert main(BenchConfig(base_url=third_party[0], model="acme-1", api_key="nope", num_requests=1)) == 2
    assert "invalid_api_key: bad key" in capsys.readouterr().err


def test_bench_imports_no_torch() -> None:
    code = (
        "import sys, wsllm.cli, wsllm.loadgen.runner, wsllm.loadgen.plots; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or m.startswith('wsllm.engine')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_concurrency_levels_parse() -> None:
    assert BenchConfig(concurrency="1, 8,32").levels() == [1, 8, 32]
    assert BenchConfig().levels() == [1] and BenchConfig(request_rate=2.0).levels() == [None]
    for bad in ("0", "1,x"):
        with pytest.raises(ValueError):
            BenchConfig(concurrency=bad)
