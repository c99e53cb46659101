"""Generation: one request's TokenEvents become text deltas. Driven through a real
memory broker and the gateway's router, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation, GenerationError
from wsllm.server.metrics import Metrics
from wsllm.server.resume import Api, ResumeContext
from wsllm.server.text import TextCodec
from wsllm.types import SamplingParams, TokenEvent, Usage


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec(str(smollm_dir))


def run(
    codec: TextCodec,
    batches: list[list[TokenEvent]],
    params: SamplingParams,
    stops: list[str],
    cancel_after: int | None = None,
) -> tuple[list[list[tuple[int, str, str | None, int]]], Generation, list[str]]:
    """Publish `batches` (all before the first next()), then read deltas to the end."""
    broker = MemoryBroker()
    gw = Gateway(GatewayConfig(), broker, codec, "m", Metrics("m"))

    async def go() -> tuple[list[list[tuple[int, str, str | None, int]]], Generation]:
        router = asyncio.create_task(gw.router.run())
        ids = codec.encode("Hi")
        gen = Generation(
            gw.models.default.svc,
            "r1",
            ids,
            params,
            ResumeContext.start(Api.COMPLETIONS, "m", ids, params, stops),
        )
        for b in batches:
            broker.publish(b)
        await asyncio.sleep(0.05)  # the router queues every event before the first read
        calls = []
        while not gen.finished:
            if cancel_after is not None and len(calls) == cancel_after:
                await gen.cancel()
            calls.append(
                [(d.index, d.text, d.finish_reason, len(d.logprobs or [])) for d in await gen.next()]
            )
        router.cancel()
        return calls, gen

    calls, gen = asyncio.run(go())
    return calls, gen, broker.aborts()


def ids(codec: TextCodec, text: str) -> list[int]:
    return codec.backend.encode(text, add_special_tokens=False).ids


def test_events_that_queued_up_go_out_as_one_delta_per_choice(codec: TextCodec) -> None:
    a, b = ids(codec, " one two three"), ids(codec, " four five")
    lp = [[-0.5, [[1, -0.5]]]]
    batches = [
        [TokenEvent("r1", 0, a[:1], 0, logprobs=lp), TokenEvent("r1", 0, b[:1], 1, logprobs=lp)],
        [TokenEvent("r1", 1, a[1:2], 0, logprobs=lp)],
        [
            TokenEvent("r1", 2, a[2:], 0, "length", logprobs=lp * len(a[2:]), usage=Usage(2, len(a))),
            TokenEvent("r1", 1, b[1:], 1, "stop", logprobs=lp * len(b[1:]), usage=Usage(2, len(b))),
        ],
    ]
    calls, gen, aborts = run(codec, batches, SamplingParams(n=2, logprobs=1), [])
    assert calls == [[(0, " one two three", "length", len(a)), (1, " four five", "stop", len(b))]]
    assert gen.usage.completion_tokens == len(a) + len(b) and aborts == []


def test_a_stop_string_ends_the_choice_and_aborts_the_engine_request(codec: TextCodec) -> None:
    t = ids(codec, " alpha beta STOP gamma delta")
    batches = [[TokenEvent("r1", i, [tok])] for i, tok in enumerate(t)]
    calls, gen, aborts = run(codec, batches, SamplingParams(), ["STOP"])
    assert "".join(text for call in calls for _, text, _, _ in call) == " alpha beta "
    assert calls[-1][-1][2] == "stop" and gen.finished
    assert aborts == ["r1"]  # the engine never sent a final event: the gateway stops it


def test_cancel_ends_every_open_choice_with_abort(codec: TextCodec) -> None:
    t = ids(codec, " a b")
    calls, _, aborts = run(codec, [[TokenEvent("r1", 0, t, 0)]], SamplingParams(n=2), [], cancel_after=1)
    assert calls[0] == [(0, " a b", None, 0)]
    assert calls[1] == [(0, "", "abort", 0), (1, "", "abort", 0)]
    assert aborts == ["r1"]


def test_an_engine_error_is_raised_once(codec: TextCodec) -> None:
    broker = MemoryBroker()
    gw = Gateway(GatewayConfig(), broker, codec, "m", Metrics("m"))

    async def go() -> None:
        router = asyncio.create_task(gw.router.run())
        params = SamplingParams()
        gen = Generation(
            gw.models.default.svc, "r1", [1], params, ResumeContext.start(Api.CHAT, "m", [1], params, [])
        )
        broker.publish(
            [TokenEvent("r1", 0, [], finish_reason="error", error="no room", error_code="invalid_request")]
        )
        with pytest.raises(GenerationError) as e:
            await gen.next()
        assert (e.value.code, e.value.message, gen.finished) == ("invalid_request", "no room", True)
        assert gw.router.request_ids() == []
        router.cancel()

    asyncio.run(go())
