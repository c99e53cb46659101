"""/v1/embeddings through the official openai client on the tiny random model (fp32):
shapes, base64 equal to float, the same text the same vector, `dimensions`, usage, the
400s in OpenAI's shape, and embeddings batched with running chat streams equal to
those computed alone."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets

from wsllm.server.api.embeddings.render import shaped

TEXTS = ["The cat sat on the mat.", "Paged attention keeps KV in blocks.", "héllo wörld ✓", "a"]
HIDDEN = 64  # the tiny model's hidden size
MAX_INPUTS = 8


@pytest.fixture(scope="module")
def server(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, max_embedding_inputs=MAX_INPUTS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


def vectors(client: openai.OpenAI, inputs: Any, **kw: Any) -> list[list[float]]:
    r = client.embeddings.create(model="", input=inputs, **kw)
    assert [d.index for d in r.data] == list(range(len(r.data)))
    return [d.embedding for d in r.data]


def test_shapes_and_usage(client: openai.OpenAI, server: Any) -> None:
    codec = server.gateway.codec
    r = client.embeddings.create(model=server.gateway.model_name, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == server.gateway.model_name
    assert len(r.data) == len(TEXTS) and all(d.object == "embedding" for d in r.data)
    assert all(len(d.embedding) == HIDDEN for d in r.data)
    assert all(abs(math.hypot(*d.embedding) - 1.0) < 1e-5 for d in r.data), "L2-normalized"
    tokens = sum(len(codec.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == tokens
    (one,) = vectors(client, TEXTS[0], encoding_format="float")
    assert one == r.data[0].embedding
    ids = codec.encode(TEXTS[1])
    assert vectors(client, ids, encoding_format="float") == [r.data[1].embedding]
    both = vectors(client, [ids, codec.encode(TEXTS[2])], encoding_format="float")
    assert both == [r.data[1].embedding, r.data[2].embedding]


def test_base64_equals_float(client: openai.OpenAI) -> None:
    floats = vectors(client, TEXTS, encoding_format="float")
    assert vectors(client, TEXTS) == floats  # the client asks for base64 and decodes it
    raw = httpx.post(
        f"{client.base_url}embeddings", json={"input": TEXTS[:1], "encoding_format": "base64"}
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)


def test_same_text_same_vector(client: openai.OpenAI) -> None:
    a, b = vectors(client, [TEXTS[1], TEXTS[1]])
    (c,) = vectors(client, TEXTS[1])
    assert abs(cosine(a, b) - 1.0) <= 1e-5 and abs(cosine(a, c) - 1.0) <= 1e-5
    assert cosine(a, vectors(client, TEXTS[0])[0]) < 0.999, "another text, another vector"


def test_dimensions_truncate_then_normalize(client: openai.OpenAI) -> None:
    (full,) = vectors(client, TEXTS[0], encoding_format="float")
    (short,) = vectors(client, TEXTS[0], encoding_format="float", dimensions=16)
    assert len(short) == 16 and abs(math.hypot(*short) - 1.0) < 1e-5
    head = full[:16]
    norm = math.hypot(*head)
    assert max(abs(s - h / norm) for s, h in zip(short, head, strict=True)) < 1e-6
    assert len(vectors(client, TEXTS[0], dimensions=HIDDEN)[0]) == HIDDEN
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="", input="x", dimensions=HIDDEN + 1)
    assert e.value.body["param"] == "dimensions" and str(HIDDEN) in e.value.body["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input.1"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"input": [49152]}, "input"),
        ({"input": list(range(3, 3000))}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "pooling": "mean"}, "pooling"),
        ({"input": [1.5]}, "input"),
    ],
)
def test_bad_requests_are_400s(server: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"].startswith(param)


def test_a_large_body_of_long_inputs(client: openai.OpenAI) -> None:
    """Inputs up to the model's context, in a body validated off the event loop."""
    long = [list(range(1000 + i, 3000 + i)) for i in range(MAX_INPUTS)]  # 2000 tokens each, ~100 KB
    r = client.embeddings.create(model="", input=long, encoding_format="float")
    assert r.usage.prompt_tokens == 2000 * MAX_INPUTS and len(r.data) == MAX_INPUTS
    assert r.data[0].embedding != r.data[1].embedding


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_batched_with_running_chats_changes_nothing(client: openai.OpenAI, server: Any) -> None:
    """The same inputs, embedded alone and while chat streams decode in the same engine
    steps, give the same vectors within 1e-4; nothing is left holding KV blocks."""
    inputs = TEXTS + [" ".join(TEXTS * 20)]
    alone = vectors(client, inputs, encoding_format="float")
    started, stop_after = threading.Barrier(4), threading.Event()
    finished_early: list[bool] = []

    def chat(i: int) -> None:
        stream = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=1500,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        started.wait(timeout=30)
        for _ in chunks:
            if stop_after.is_set():
                break
        finished_early.append(not stop_after.is_set())
        stream.close()  # the rest of its 1,500 tokens would only cost time; the abort frees it

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=30)
    batched = vectors(client, inputs, encoding_format="float")
    stop_after.set()
    for t in threads:
        t.join(timeout=120)
    assert not all(finished_early), "the chats were streaming beside the embeddings"
    for a, b in zip(alone, batched, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    server.assert_no_blocks_held()


def test_websocket_embeddings_message(client: openai.OpenAI, server: Any) -> None:
    """An `embeddings` message gets the HTTP answer's body with its id; a bad one an
    `error` naming the field, and the socket stays."""
    want = vectors(client, TEXTS[:2], encoding_format="float")

    async def talk() -> list[dict[str, Any]]:
        async with websockets.connect(server.ws_url) as ws:
            assert orjson.loads(await ws.recv())["type"] == "hello"
            await ws.send(orjson.dumps({"type": "embeddings", "id": "bad", "input": []}))
            await ws.send(orjson.dumps({"type": "embeddings", "id": "e1", "input": TEXTS[:2]}))
            return [orjson.loads(await ws.recv()) for _ in range(2)]

    got = {m["id"]: m for m in asyncio.run(talk())}
    assert got["bad"]["type"] == "error" and got["bad"]["param"] == "input"
    answer = got["e1"]
    assert answer["type"] == "embeddings" and answer["object"] == "list"
    assert [d["embedding"] for d in answer["data"]] == want
    assert answer["usage"]["prompt_tokens"] > 0


def test_shaped_is_little_endian_float32() -> None:
    packed = shaped([3.0, 4.0, 12.0], 2)
    assert packed == b"\x9a\x99\x19?\xcd\xccL?"  # 0.6, 0.8 as <f4
    assert shaped([0.0, 0.0], None) == bytes(8)
