"""A bad image is a 400 in each API's own error shape naming the part, and nothing is
sent to an engine: not an image, a truncated PNG, over the pixel or the byte limit, too
many images, an `http` URL, and an image for a model that cannot see (the tiny text
model), on OpenAI's chat, Anthropic's Messages, the Responses API and the WebSocket."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets
from PIL import Image as PILImage

LIMITS = dict(max_image_pixels=32 * 32, max_image_bytes=8192, max_images_per_request=2)


def png(size: tuple[int, int], noise: bool = False) -> bytes:
    img = PILImage.effect_noise(size, 64).convert("RGB") if noise else PILImage.new("RGB", size, (9, 99, 199))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


GOOD = png((8, 8))
NOISE = png((24, 24), noise=True)
# (case, the images of the user message, the words of the 400, which image it names)
CASES: list[tuple[str, list[bytes | str], str, int]] = [
    ("not an image", [b"no picture here"], "is not a PNG, JPEG, WebP or GIF image", 0),
    ("truncated png", [NOISE[: len(NOISE) // 2]], "the PNG image does not decode", 0),
    ("over the pixels", [GOOD, png((33, 32))], "1056 pixels; this server's limit is 1024", 1),
    ("over the bytes", [b"\x89PNG" + bytes(9000)], "this server's limit is 8192", 0),
    ("too many images", [GOOD, GOOD, GOOD], "at most 2 images in a request", 2),
    ("an http url", ["http://169.254.169.254/latest.png"], "not fetched by this server", 0),
    ("a model that cannot see", [GOOD], "cannot see images", 0),
]


@pytest.fixture(scope="module")
def srv(live_server: Any, tiny_engine: Any) -> Iterator[Any]:
    with live_server(tiny_engine, **LIMITS) as s:
        yield s


def _url(image: bytes | str) -> str:
    return image if isinstance(image, str) else "data:image/png;base64," + base64.b64encode(image).decode()


def _chat(srv: Any, shown: list[bytes | str]) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": _url(x)}} for x in shown]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *parts]}]}


def _anthropic_source(image: bytes | str) -> dict[str, Any]:
    if isinstance(image, str):
        return {"type": "url", "url": image}
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}


def _messages(srv: Any, shown: list[bytes | str]) -> dict[str, Any]:
    blocks = [{"type": "image", "source": _anthropic_source(x)} for x in shown]
    content = [{"type": "text", "text": "What is it?"}, *blocks]
    return {
        "model": srv.gateway.model_name,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": content}],
    }


def _responses(srv: Any, shown: list[bytes | str]) -> dict[str, Any]:
    parts = [{"type": "input_image", "image_url": _url(x)} for x in shown]
    return {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, *parts]}]}


# (route, its body with these images, its error's param for the part at index k)
APIS: dict[str, tuple[str, Callable[[Any, list[bytes | str]], dict[str, Any]], str]] = {
    "chat": ("/v1/chat/completions", _chat, "messages.0.content.{}"),
    "messages": ("/v1/messages", _messages, "messages.0.content.{}"),
    "responses": ("/v1/responses", _responses, "input.0.content.{}"),
}


def _submitted(srv: Any) -> float:
    """Prompt tokens the gateway has sent to its engines (read in-process: no /metrics)."""
    families = srv.gateway.metrics.registry.collect()
    return sum(s.value for f in families if f.name == "wsllm_prompt_tokens" for s in f.samples)


def _error(api: str, r: httpx.Response) -> tuple[str, str | None]:
    """The 400's message and param, checked to be in the API's own shape."""
    assert r.status_code == 400, r.text
    body = r.json()
    if api == "messages":  # Anthropic's: the part is named in the message
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], None
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_request"
    return body["error"]["message"], body["error"]["param"]


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(("case", "shown", "words", "named"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_image_is_a_400_in_the_apis_shape_naming_the_part(
    srv: Any, api: str, case: str, shown: list[bytes | str], words: str, named: int
) -> None:
    path, body, param = APIS[api]
    part = param.format(named + 1)  # the text part comes first
    if api == "messages" and case == "an http url":
        part += ".source"  # Anthropic's URL is a kind of source
    before = _submitted(srv)
    message, got = _error(api, httpx.post(srv.base_url + path, json=body(srv, shown), timeout=30))
    assert message.startswith(part + ": ") and words in message, message
    assert got in (None, part)
    assert _submitted(srv) == before  # nothing was sent to an engine


def test_the_websocket_names_the_part_and_goes_on(srv: Any) -> None:
    async def run() -> list[dict[str, Any]]:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await ws.recv()  # hello
            for i, (_, shown, _, _) in enumerate(CASES):
                await ws.send(orjson.dumps({"type": "chat", "id": str(i), **_chat(srv, shown)}).decode())
            got = [orjson.loads(await ws.recv()) for _ in CASES]
            text = {
                "type": "chat",
                "id": "ok",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            }
            await ws.send(orjson.dumps(text).decode())
            while (m := orjson.loads(await ws.recv()))["type"] != "done":
                pass
            return [*got, m]

    before = _submitted(srv)
    got = asyncio.run(run())
    assert _submitted(srv) > before  # the count sees a request that reached the engine
    errors = {m["id"]: m for m in got[:-1]}  # each an error of its own id, in any order
    for i, (_, _, words, named) in enumerate(CASES):
        m = errors[str(i)]
        assert m["type"] == "error" and m["param"] == f"messages.0.content.{named + 1}", m
        assert words in m["message"]
    assert got[-1]["id"] == "ok"  # the socket serves the next request
