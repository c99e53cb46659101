"""Stop strings and multi-byte text end to end, with SmolLM2 and greedy decoding:
what the API sends is LLM.generate's text, cut before the stop string, and the
engine stops working on the request once a stop string matched."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets

from wsllm import SamplingParams

PROMPTS = {
    "en": "The capital of France is",  # ' Paris.\n\nThe answer is: ...'
    "emoji": "Emoji list: 🦀 crab, 🐍 snake, 🐘",  # ' dragon, 🐵 dragon, 🐵 ...'
    "zh": "中文：你好，世界。我是",
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(smollm_llm: Any) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results = smollm_llm.generate(list(PROMPTS.values()), params)
    return {k: r.text for k, r in zip(PROMPTS, results, strict=True)}


@pytest.fixture(scope="module")
def srv(live_server: Any, smollm_engine: Any, expected: dict[str, str]) -> Iterator[Any]:
    with live_server(smollm_engine) as s:
        yield s


def stream(srv: Any, prompt: str, **kw: Any) -> tuple[list[str], str | None, str]:
    """Streamed /v1/completions: (text pieces, finish_reason, request id)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True} | kw
    pieces, finish, rid = [], None, ""
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                rid = chunk["id"]
                for c in chunk["choices"]:
                    pieces.append(c["text"])
                    finish = c["finish_reason"] or finish
    return pieces, finish, rid


def assert_same_text(streamed: str, full: str) -> None:
    """Equal, but for a character that max_tokens cut in half at the very end: a full
    decode shows it as U+FFFD; streaming holds that last token back and never sends it."""
    assert full.startswith(streamed) and set(full[len(streamed) :]) <= {" ", "\ufffd"}, (streamed, full)


@pytest.mark.parametrize("lang", list(PROMPTS))
def test_multibyte_text_streams_without_replacement_chars(
    srv: Any, expected: dict[str, str], lang: str
) -> None:
    pieces, finish, _ = stream(srv, PROMPTS[lang])
    assert not any("\ufffd" in p for p in pieces)
    assert_same_text("".join(pieces), expected[lang])
    assert finish == "length"


@pytest.mark.parametrize(
    ("lang", "stop"),
    [("en", "is.\n\nThe"), ("emoji", "🐵 d"), ("zh", "会议")],
    ids=["spans four tokens, starts mid-token", "emoji", "CJK"],
)
def test_a_stop_string_split_across_tokens_is_caught(
    srv: Any, expected: dict[str, str], lang: str, stop: str
) -> None:
    full = expected[lang]
    assert stop in full
    pieces, finish, rid = stream(
        srv, PROMPTS[lang], stop=[stop, "never-seen"], max_tokens=400, ignore_eos=True
    )
    assert "".join(pieces) == full[: full.index(stop)] and finish == "stop"
    assert not any("\ufffd" in p for p in pieces)
    # The gateway aborted the engine request: it does not run to its 400 tokens.
    srv.assert_engine_forgot(rid)


def test_a_partial_match_is_released(srv: Any, expected: dict[str, str]) -> None:
    # "is.\n\n" is held while it could still become the stop string, then sent.
    pieces, finish, _ = stream(srv, PROMPTS["en"], stop="is.\n\nX")
    assert_same_text("".join(pieces), expected["en"])
    assert finish == "length"
    assert " Par" in pieces and "is.\n\nThe" in pieces


def test_stop_on_the_chat_api_and_the_socket(srv: Any) -> None:
    msgs = [{"role": "user", "content": "Count from 1 to 10 separated by commas."}]
    body = {"messages": msgs, "max_tokens": 40, "temperature": 0}
    full = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=120).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    stopped = httpx.post(
        f"{srv.base_url}/v1/chat/completions", json=body | {"stop": stop}, timeout=120
    ).json()
    assert stopped["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"

    async def over_ws() -> tuple[str, dict[str, Any]]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.recv()  # hello
            await ws.send(orjson.dumps({"type": "chat", "id": "s", "stop": [stop]} | body).decode())
            pieces = []
            while (m := orjson.loads(await ws.recv()))["type"] in ("started", "delta"):
                pieces.append(m.get("text", ""))
            return "".join(pieces), m

    got, done = asyncio.run(over_ws())
    assert got == text[: text.index(stop)]
    assert (done["type"], done["finish_reason"]) == ("done", "stop")
