"""A chat Generation splits its text into reasoning, content and tool calls: token
events (the real SmolLM2 tokenizer) through a real memory broker and router, cut into
events at random places, give the same answer as the text parsed whole."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import orjson
import pytest

from wsllm.broker.memory import MemoryBroker
from wsllm.config_gateway import GatewayConfig
from wsllm.server.chat.output import OutputOptions, assemble_tool_calls
from wsllm.server.chat.reasoning import ThinkSplitter
from wsllm.server.chat.registry import get_style
from wsllm.server.delta import Delta
from wsllm.server.gateway import Gateway
from wsllm.server.generation import Generation
from wsllm.server.metrics import Metrics
from wsllm.server.resume import Api, ResumeContext
from wsllm.server.text import TextCodec
from wsllm.types import SamplingParams, TokenEvent

OUTPUT = (
    "<think>\nThe user wants the weather in Oslo and the time. Two calls.\n</think>\n\n"
    "I'll check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Oslo"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def codec(smollm_dir: Path) -> TextCodec:
    return TextCodec(str(smollm_dir))


def generate(
    codec: TextCodec, text: str, output: OutputOptions | None, rng: random.Random, api: str = "chat"
) -> tuple[list[Delta], Generation]:
    ids = codec.backend.encode(text, add_special_tokens=False).ids
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 12))))
    spans = list(zip([0, *cuts], [*cuts, len(ids)], strict=True))
    broker = MemoryBroker()
    gw = Gateway(GatewayConfig(), broker, codec, "m", Metrics("m"))

    async def go() -> tuple[list[Delta], Generation]:
        router = asyncio.create_task(gw.router.run())
        prompt = codec.encode_chat([{"role": "user", "content": "Weather and time in Oslo?"}])
        params, out = SamplingParams(), output
        gen = Generation(
            gw.models.default.svc,
            "r1",
            prompt,
            params,
            ResumeContext.start(Api(api), "m", prompt, params, [], out),
        )
        for seq, (a, b) in enumerate(spans):
            broker.publish([TokenEvent("r1", seq, ids[a:b], 0, "stop" if b == len(ids) else None)])
        await asyncio.sleep(0.05)
        deltas = []
        while not gen.finished:
            deltas += await gen.next()
        router.cancel()
        return deltas, gen

    return asyncio.run(go())


def test_reasoning_content_and_calls_come_apart_however_the_tokens_arrive(codec: TextCodec) -> None:
    reasoning, answer = ThinkSplitter().split(OUTPUT)
    whole = get_style("hermes").parse(answer, "r1/0")
    assert len(whole.calls) == 2 and whole.content == "I'll check both."
    rng = random.Random(0)
    for _ in range(10):
        deltas, _ = generate(codec, OUTPUT, OutputOptions(tool_parser="hermes"), rng)
        assert "".join(d.reasoning for d in deltas) == reasoning
        assert "".join(d.text for d in deltas) == whole.content
        calls = assemble_tool_calls([c for d in deltas for c in d.tool_calls or []])
        assert calls == [c.as_json() for c in whole.calls]
        assert deltas[-1].finish_reason == "tool_calls"


def test_without_tools_a_chat_still_splits_reasoning_and_keeps_tool_text(codec: TextCodec) -> None:
    deltas, gen = generate(codec, OUTPUT, None, random.Random(1))
    assert "".join(d.reasoning for d in deltas).startswith("The user wants")
    assert "".join(d.text for d in deltas).endswith("</tool_call>")
    assert deltas[-1].finish_reason == "stop" and not any(d.tool_calls for d in deltas)
    assert gen.context.encode()["output"] == {"tool_parser": None, "reasoning": True}  # as a resume reads it


def test_a_completion_is_left_as_it_is(codec: TextCodec) -> None:
    deltas, gen = generate(codec, OUTPUT, None, random.Random(2), api="completions")
    assert "".join(d.text for d in deltas) == OUTPUT and gen.context.output is None


def test_the_options_survive_a_resume_context() -> None:
    opts = OutputOptions(tool_parser="mistral", reasoning=False)
    assert OutputOptions.from_context(opts.to_context()) == opts
    typed = OutputOptions(tool_parser="qwen3_coder", arg_types={"f": {"n": ["integer"]}})
    assert OutputOptions.from_context(orjson.loads(orjson.dumps(typed.to_context()))) == typed
    assert OutputOptions.from_context(None) is None
