"""gpt-oss's harmony answers (server/chat/styles/harmony.py) as a chat answer's output: the
analysis channel as reasoning, the final channel as content, commentary calls as OpenAI
tool calls; streamed in any split as whole, whatever the text (random strings of markers,
words and JSON never raise, and no marker reaches the client); a template of gpt-oss's shape
picks the style with or without tools, and its answers keep their special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.config_gateway import GatewayConfig
from wsllm.server.chat.calls import Parsed
from wsllm.server.chat.output import ChoiceOutput, OutputOptions, assemble_tool_calls
from wsllm.server.chat.plan import plan_chat
from wsllm.server.chat.registry import get_style
from wsllm.server.chat.styles.harmony import MARKERS
from wsllm.server.schemas import ChatRequest, validate_http
from wsllm.server.text import TextCodec

HARMONY = OutputOptions(tool_parser="harmony")
ANSWER = (
    "<|channel|>analysis<|message|>The user asks for Oslo's weather. <think>no tags here</think>"
    "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo", "unit": "C"}<|call|>'
)


def run(out: ChoiceOutput, pieces: list[str]) -> tuple[str, str, list[dict]]:
    reasoning = content = ""
    deltas: list[dict] = []
    for k, piece in enumerate(pieces):
        p = out.feed(piece, final=k == len(pieces) - 1)
        reasoning, content, deltas = reasoning + p.reasoning, content + p.content, deltas + p.tool_calls
    return reasoning, content, deltas


def test_the_channels_become_reasoning_content_and_calls_streamed_as_whole() -> None:
    """The `<think>` splitter stays out (a tag in the analysis is its text); the call's
    deltas assemble to the call; the finish reason is tool_calls."""
    whole = run(ChoiceOutput(HARMONY, "r/0"), [ANSWER])
    assert whole[0] == "The user asks for Oslo's weather. <think>no tags here</think>"
    assert whole[1] == ""
    calls = assemble_tool_calls(whole[2])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    for i in range(len(ANSWER) + 1):
        out = ChoiceOutput(HARMONY, "r/0")
        assert run(out, [ANSWER[:i], ANSWER[i:]]) == whole, i
    assert out.finish_reason("stop") == "tool_calls"
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!"
    assert run(ChoiceOutput(HARMONY, "r/0"), list(final)) == ("Easy.", "Hi there!", [])


def test_an_answer_cut_by_max_tokens_keeps_what_it_has() -> None:
    style = get_style("harmony")
    assert style.parse("<|channel|>analysis<|message|>Thinking about") == Parsed("", [], "Thinking about")
    cut = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": '
    assert style.parse(cut) == Parsed('{"a": ', [], "")  # no arguments object: text


WORDS = ["analysis", "final", "commentary", " to=functions.f ", "json", '{"a": 1}', "{", "assistant", "Hello"]
PIECES = st.sampled_from([*MARKERS, *WORDS, ", world", " ", "\n", "<|", "|>", "<|chan"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=14), st.data())
def test_any_text_parses_streamed_as_whole_and_no_marker_reaches_the_client(
    words: list[str], data: st.DataObject
) -> None:
    text = "".join(words)
    style = get_style("harmony")
    whole = style.parse(text, "r")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    stream, got = style.stream("r"), Parsed()
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        p = stream.feed(text[a:b])
        got = Parsed(got.content + p.content, got.calls + p.calls, got.reasoning + p.reasoning)
    end = stream.finish()
    assert Parsed(got.content + end.content, got.calls + end.calls, got.reasoning + end.reasoning) == whole
    for m in MARKERS:
        assert m not in whole.content and m not in whole.reasoning
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole.calls)


def test_a_gpt_oss_shaped_template_reads_every_answer_as_harmony_with_its_special_tokens(
    tiny_harmony_dir: Path, smollm_dir: Path
) -> None:
    codec = TextCodec(str(tiny_harmony_dir))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    req = validate_http(ChatRequest, orjson.dumps(body), GatewayConfig())
    assert isinstance(req, ChatRequest)
    plan = plan_chat(req, codec, "tiny")
    assert plan.output.tool_parser == "harmony" and plan.output.whole_answer  # no tools offered
    assert not plan_chat(req, TextCodec(str(smollm_dir)), "tiny").output.whole_answer
    prompt = codec.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    ids = codec.encode("<|channel|>final<|message|>Hello<|return|>")
    assert len(ids) <= 6, "the markers are single tokens"
    assert (
        codec.detokenizer(prompt, special_tokens=True).feed(ids)
        == "<|channel|>final<|message|>Hello<|return|>"
    )
    assert codec.detokenizer(prompt).feed(ids) == "finalHello"


def test_a_marker_cut_after_a_message_is_no_text_between_messages() -> None:
    """Found by the property above: " <" then "|start|>" after a message's end is the next
    message's start, not text, in every cut of the answer."""
    style = get_style("harmony")
    for text in ("<|start|><|message|><|end|> <|start|>", "<|channel|>final<|message|>Hi<|end|>\n<|start|>"):
        whole = style.parse(text, "r")
        for i in range(len(text) + 1):
            stream = style.stream("r")
            a, b, end = stream.feed(text[:i]), stream.feed(text[i:]), stream.finish()
            assert (a.content + b.content + end.content, a.reasoning + b.reasoning) == (whole.content, ""), i
