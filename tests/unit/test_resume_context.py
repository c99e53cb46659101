"""The ResumeContext (wsllm/server/resume.py) that crosses Redis with a resumable
request: what one gateway writes another reads back the same, a context written by a
gateway that predates the type still reads, and one that is not a context is refused
by name."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from wsllm.server.chat.output import OutputOptions
from wsllm.server.resume import CONTEXT_TAIL, Api, ResumeContext
from wsllm.types import SamplingParams


def test_a_context_survives_the_broker_as_json() -> None:
    params = SamplingParams(n=3, logprobs=2)
    prompt = list(range(100, 120))
    ctx = ResumeContext.start(Api.WS_CHAT, "m", prompt, params, ["\n"], OutputOptions("hermes"), True)
    ctx.token_sha256 = "ab" * 32
    back = ResumeContext.decode(orjson.loads(orjson.dumps(ctx.encode())))
    assert back == ctx
    assert (back.n, back.logprobs, back.prompt_len) == (3, 2, 20)
    assert back.prompt_tail == prompt[-CONTEXT_TAIL:] and back.api.is_chat


def test_what_an_older_gateway_wrote_still_reads() -> None:
    # The untyped dict of the gateways before ResumeContext: the same keys.
    old = {
        "api": "chat",
        "n": 1,
        "logprobs": None,
        "stops": [],
        "prompt_len": 5,
        "prompt_tail": [1, 2, 3, 4, 5],
        "created": 1700000000,
        "output": {"tool_parser": None, "reasoning": True},
        "model": "smol",
        "include_usage": True,
        "token_sha256": "cd" * 32,
    }
    ctx = ResumeContext.decode(old)
    assert ctx.api is Api.CHAT and ctx.model == "smol" and ctx.include_usage
    assert ctx.encode() == old  # and it reads what this one writes


@pytest.mark.parametrize(
    ("bad", "name"),
    [
        ({"api": "telepathy"}, "telepathy"),
        ({"api": "chat", "n": "2"}, "n"),
        ({"api": "chat", "prompt_tail": [1, None]}, "prompt_tail"),
        ({"api": "chat", "stops": "\n"}, "stops"),
        ({"api": "chat", "output": []}, "output"),
    ],
)
def test_a_context_that_is_not_one_is_refused_by_name(bad: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ResumeContext.decode(bad)


def test_chat_apis_get_chat_ids() -> None:
    assert [a.id_prefix for a in Api] == [
        "chatcmpl",
        "cmpl",
        "chatcmpl",
        "cmpl",
        "msg",
        "resp",
        "embd",
        "tok",
        "lora",
    ]
    assert [a.is_chat for a in Api] == [True, False, True, False, True, True, False, False, False]
