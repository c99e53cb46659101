"""The <think> splitter: reasoning vs content, whole and streamed in any split."""

from __future__ import annotations

import random

import pytest

from wsllm.server.chat.output import ChoiceOutput, OutputOptions
from wsllm.server.chat.reasoning import ReasoningTags, ThinkSplitter, prompt_opens_think

# (output, starts inside the block, reasoning, content)
CASES = [
    (  # Qwen3 with thinking on
        "<think>\nOkay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is 4.",
        False,
        "Okay, the user asks for 2 + 2. That is 4.\n",
        "The answer is 4.",
    ),
    (  # DeepSeek-R1: the template opened the block in the prompt
        "Hmm, Paris is the capital.\n</think>\n\nParis.",
        True,
        "Hmm, Paris is the capital.\n",
        "Paris.",
    ),
    ("Paris is the capital of France.", False, "", "Paris is the capital of France."),
    (  # the tag counts only at the start of the output
        "Use <think> tags like <think>this</think>.",
        False,
        "",
        "Use <think> tags like <think>this</think>.",
    ),
    ("  \n<think>a</think>b", False, "a", "b"),
    (
        "<think>cut by max_tokens before the end of the thou",
        False,
        "cut by max_tokens before the end of the thou",
        "",
    ),
    ("<thinking>is not the tag</thinking>", False, "", "<thinking>is not the tag</thinking>"),
    ("<th", False, "", "<th"),
    ("\n\nHello", False, "", "\n\nHello"),
    ("<think></think>Done", False, "", "Done"),
    ("Thinking about </thi", True, "Thinking about </thi", ""),
]


@pytest.mark.parametrize(("text", "in_think", "reasoning", "content"), CASES)
def test_split_whole(text: str, in_think: bool, reasoning: str, content: str) -> None:
    assert ThinkSplitter(in_think).split(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "in_think"), [(c[0], c[1]) for c in CASES])
def test_split_streamed_in_random_pieces(text: str, in_think: bool) -> None:
    whole = ThinkSplitter(in_think).split(text)
    rng = random.Random(text)
    for _ in range(100):
        s = ThinkSplitter(in_think)
        r = c = ""
        i = 0
        while i < len(text):
            j = i + rng.choice([0, 1, 1, 2, 3, 7])
            dr, dc = s.feed(text[i:j])
            r, c, i = r + dr, c + dc, j
        dr, dc = s.finish()
        assert (r + dr, c + dc) == whole


def test_other_tags_split_the_same_way() -> None:
    """The splitter is its tags: a model that writes other ones is split by them, and
    <think> is then text."""
    tags = ReasoningTags("<reasoning>", "</reasoning>")
    text = "<reasoning>\nIt is 4.\n</reasoning>\n\n<think>4</think>"
    assert ThinkSplitter(tags=tags).split(text) == ("It is 4.\n", "<think>4</think>")
    s, r, c = ThinkSplitter(tags=tags), "", ""
    for ch in text:  # one character at a time: every tag is split
        dr, dc = s.feed(ch)
        r, c = r + dr, c + dc
    assert (r, c) == ("It is 4.\n", "<think>4</think>")
    assert prompt_opens_think("<reasoning>\n", tags) and not prompt_opens_think("<think>\n", tags)


def test_prompt_opens_think() -> None:
    assert prompt_opens_think("<｜Assistant｜><think>\n")
    # Qwen3 with enable_thinking false closes an empty block in the prompt
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_reasoning_then_tool_calls() -> None:
    """Qwen3 thinks, then calls: the call is parsed from the answer only, and a
    <tool_call> written inside the reasoning is not a call."""
    text = (
        '<think>\nI should call <tool_call>{"name": "no", "arguments": {}}</tool_call>? Yes, get_weather.\n</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    out = ChoiceOutput(OutputOptions(tool_parser="hermes"), "r/0")
    p = out.feed(text, final=True)
    assert p.reasoning.startswith("I should call <tool_call>") and p.content == ""
    assert [d["function"].get("name") for d in p.tool_calls] == ["get_weather", None]
    assert p.tool_calls[1]["function"]["arguments"] == '{"city": "Oslo"}'
