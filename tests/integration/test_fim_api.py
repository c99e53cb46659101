"""`suffix` on /v1/completions through the real app: on a tiny random model whose
tokenizer has Qwen2.5-Coder's FIM tokens, the engine reads prefix-suffix-middle (its
prompt tokens, seen through `prompt_logprobs` and `usage`), over HTTP, the official
client and the WebSocket; a model without FIM tokens, a list of prompts, token ids and
`echo` are 400s naming `suffix`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets

from wsllm.config import EngineConfig
from wsllm.server.text import TextCodec


@pytest.fixture(scope="module")
def fim_server(live_server: Any, tiny_fim_model_dir: Path) -> Iterator[Any]:
    from wsllm.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_fim_model_dir), num_kv_blocks=256, max_num_seqs=8, dtype="float32")
    )
    with live_server(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def ids(tiny_fim_model_dir: Path) -> dict[str, int]:
    codec = TextCodec(str(tiny_fim_model_dir))
    names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "w1", "w2", "w3"]
    return {n: codec.token_id(n) for n in names}  # type: ignore[misc]


def complete(srv: Any, body: dict[str, Any]) -> httpx.Response:
    body = {"max_tokens": 2, "temperature": 0} | body
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)


def test_the_engine_reads_prefix_suffix_middle(fim_server: Any, ids: dict[str, int]) -> None:
    r = complete(fim_server, {"prompt": "w1 w2", "suffix": "w3", "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    # The first prompt token has no logprob (nothing predicts it): `usage` counts it.
    assert body["usage"]["prompt_tokens"] == 6
    table = body["choices"][0]["prompt_logprobs"]
    assert table[0] is None
    seen = [int(next(iter(entry))) for entry in table[1:]]
    assert seen == [ids[n] for n in ("w1", "w2", "<|fim_suffix|>", "w3", "<|fim_middle|>")]
    assert body["usage"]["completion_tokens"] >= 1  # and the model writes a middle


def test_the_official_client_sends_suffix(fim_server: Any) -> None:
    client = openai.OpenAI(base_url=f"{fim_server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="w1", suffix="w2 w3", max_tokens=1, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == 6  # 3 tags, 3 words


def test_suffix_on_the_websocket(fim_server: Any) -> None:
    msg = {"type": "completion", "id": "f", "prompt": "w1", "suffix": "w2", "max_tokens": 1}

    async def go() -> list[dict[str, Any]]:
        async with websockets.connect(fim_server.ws_url) as ws:
            await ws.recv()  # hello
            await ws.send(orjson.dumps(msg))
            got: list[dict[str, Any]] = []
            while not got or got[-1].get("type") not in ("done", "error"):
                got.append(orjson.loads(await ws.recv()))
            return got

    events = asyncio.run(go())
    assert events[-1]["type"] == "done", events
    assert events[-1]["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ["w1", "w2"], "suffix": "w3"}, "list of prompts"),
        ({"prompt": [4, 5], "suffix": "w3"}, "token ids"),
        ({"prompt": "w1", "suffix": "w3", "echo": True}, "echo"),
    ],
)
def test_what_suffix_does_not_take_is_a_400_naming_it(
    fim_server: Any, body: dict[str, Any], reason: str
) -> None:
    r = complete(fim_server, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "suffix" and reason in err["message"]


def test_a_model_without_fim_tokens_is_a_400_naming_suffix_and_why(tiny_server: Any) -> None:
    r = complete(tiny_server, {"prompt": "def f(", "suffix": "):"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "suffix" and "no fill-in-the-middle tokens" in err["message"]
    assert complete(tiny_server, {"prompt": "def f("}).status_code == 200  # and it costs nothing
