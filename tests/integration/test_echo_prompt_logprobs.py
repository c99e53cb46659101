"""`echo` and prompt logprobs on /v1/completions (issue 13), through the real app on the
tiny random model: OpenAI's shape (the prompt's text before the answer; with `logprobs`,
the prompt's tokens first, the first with null logprobs) and vLLM's `prompt_logprobs`
(per prompt token: null, then {token id: {logprob, rank, decoded_token}}), streamed and
not, agreeing with each other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

PROMPT = [11, 250, 3000, 42, 7]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine) as s:
        yield s


def post(srv: Any, **body: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True} | body
    r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(srv: Any, **body: Any) -> list[dict[str, Any]]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True} | body
    chunks = []
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(orjson.loads(line[6:]))
    return chunks


def test_echo_puts_the_prompt_before_the_answer_streamed_and_not(srv: Any) -> None:
    plain = post(srv)["choices"][0]["text"]
    prompt_text = srv.gateway.codec.backend.decode(PROMPT, skip_special_tokens=False)
    echoed = post(srv, echo=True)["choices"][0]["text"]
    assert echoed == prompt_text + plain
    streamed = "".join(c["choices"][0]["text"] for c in stream(srv, echo=True) if c["choices"])
    assert streamed == echoed
    text_prompt = post(srv, prompt="Once upon a time", echo=True, max_tokens=2)["choices"][0]["text"]
    assert text_prompt.startswith("Once upon a time")


def test_echo_with_logprobs_scores_the_prompt_tokens_too(srv: Any) -> None:
    got = post(srv, echo=True, logprobs=2, prompt_logprobs=2)["choices"][0]
    lp = got["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts token 0
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == got["text"]
    # the same numbers in vLLM's shape, keyed by token id
    vllm = got["prompt_logprobs"]
    assert len(vllm) == len(PROMPT) and vllm[0] is None
    for i, tid in enumerate(PROMPT[1:], 1):
        assert vllm[i][str(tid)]["logprob"] == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
        ranks = sorted(e["rank"] for e in vllm[i].values() if "rank" in e)
        assert ranks == [1, 2]  # the top 2, ranked
        best = max(vllm[i].values(), key=lambda e: e["logprob"])
        assert best.get("rank") == 1 and best["decoded_token"] in lp["top_logprobs"][i]


def test_prompt_logprobs_alone_leave_the_text_and_come_once_when_streamed(srv: Any) -> None:
    got = post(srv, prompt_logprobs=0)["choices"][0]
    assert got["text"] == post(srv)["choices"][0]["text"] and got["logprobs"] is None
    entries = got["prompt_logprobs"]
    assert entries[0] is None and all(
        list(e) == [str(t)] for e, t in zip(entries[1:], PROMPT[1:], strict=True)
    )
    chunks = [c for c in stream(srv, prompt_logprobs=0) if c["choices"]]
    with_plp = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(with_plp) == 1 and with_plp[0]["choices"][0]["prompt_logprobs"] == entries


def test_too_many_prompt_logprobs_is_a_400(srv: Any) -> None:
    r = httpx.post(
        f"{srv.base_url}/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 21}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
