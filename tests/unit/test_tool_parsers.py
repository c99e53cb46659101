"""Tool-call parsers on output text of each family, parsed whole and streamed in
random splits: the streamed pieces assemble to the whole parse, and broken JSON comes
back as content."""

from __future__ import annotations

import json
import random

import pytest

from wsllm.server.chat_output import ChoiceOutput, OutputOptions, assemble_tool_calls
from wsllm.server.tool_parsers import Parsed, parse_tool_calls, tool_stream

# (parser, output text, expected content, expected [(name, arguments object)])
CASES: list[tuple[str, str, str, list[tuple[str, dict[str, object]]]]] = [
    (  # Qwen2.5-Instruct, two parallel calls (the format of Qwen's function-calling guide)
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
        '"San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>',
        "",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    (  # Hermes 2 Pro writes the arguments first; text before the call is the content
        "hermes",
        "Let me look that up for you.\n<tool_call>\n"
        '{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>\n',
        "Let me look that up for you.",
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
    ),
    (  # broken JSON (a brace missing) is content; the good call after it still counts
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"b": "</tool"}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        [("g", {"b": "</tool"})],
    ),
    (  # cut by max_tokens inside a call: content, not an exception
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (  # a call whose closing tag never came, but whose JSON is whole
        "hermes",
        '<tool_call>\n{"name": "ping", "arguments": {}}',
        "",
        [("ping", {})],
    ),
    ("hermes", "No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = 4.\n", []),
    (  # JSON that is not a call (no name) is content
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (  # Llama 3.1, JSON tool calling
        "llama3_json",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (  # with <|python_tag|>, several separated by ';', unicode and nesting
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"query": "Zürich \\"weather\\" {today}"}}; '
        '{"name": "book", "parameters": {"seats": [{"row": 3, "ok": true}], "note": null}}',
        "",
        [
            ("search", {"query": 'Zürich "weather" {today}'}),
            ("book", {"seats": [{"row": 3, "ok": True}], "note": None}),
        ],
    ),
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (  # broken JSON: the whole text is content
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"]}',
        '{"name": "get_weather", "parameters": {"city": "Paris"]}',
        [],
    ),
    (  # a call, then prose: the prose is content
        "llama3_json",
        '{"name": "a", "parameters": {"x": 1}} I called a.',
        "I called a.",
        [("a", {"x": 1})],
    ),
    (  # Mistral 7B Instruct v0.3, as the tokenizer writes it with special tokens kept
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "",
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_time", {"tz": "Europe/Paris"}),
        ],
    ),
    (  # the same as the gateway sees it: the detokenizer drops the special [TOOL_CALLS]
        "mistral",
        ' [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
        "",
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "mistral",
        'I will check. [TOOL_CALLS][{"name": "lookup", "arguments": "{\\"id\\": 7}"}]',
        "I will check.",
        [("lookup", {"id": 7})],
    ),
    ("mistral", "[1] See the footnote.", "[1] See the footnote.", []),
    (  # broken: an element is not a call, so the whole list is content
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"nom": "b"}]',
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"nom": "b"}]',
        [],
    ),
]


def as_pairs(p: Parsed) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_text_parse(
    parser: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    p = parse_tool_calls(parser, text, "req-1")
    assert p.content == content
    assert as_pairs(p) == calls
    assert len({c.id for c in p.calls}) == len(p.calls)


def feed_in_pieces(parser: str, text: str, rng: random.Random) -> Parsed:
    stream = tool_stream(parser, "req-1")
    out = Parsed()
    i = 0
    while i < len(text):
        j = i + rng.choice([0, 1, 1, 2, 3, 5, 8, 20])
        got = stream.feed(text[i:j])
        out.content += got.content
        out.calls += got.calls
        i = j
    end = stream.finish()
    return Parsed(out.content + end.content, out.calls + end.calls)


@pytest.mark.parametrize(("parser", "text"), [(c[0], c[1]) for c in CASES])
def test_streamed_in_random_pieces_equals_the_whole_parse(parser: str, text: str) -> None:
    whole = parse_tool_calls(parser, text, "req-1")
    rng = random.Random(text)
    for _ in range(100):
        assert feed_in_pieces(parser, text, rng) == whole


def test_call_deltas_assemble_to_the_whole_parse() -> None:
    """The OpenAI-shaped deltas a stream sends: name first (with its id), arguments
    after, per index; assembled as a client does, they are the calls."""
    text = CASES[0][1]
    whole = parse_tool_calls("hermes", text, "r/0")
    rng = random.Random(1)
    out = ChoiceOutput(OutputOptions(tool_parser="hermes"), "r/0")
    deltas, content = [], ""
    cuts = sorted(rng.sample(range(1, len(text)), 30))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for k, piece in enumerate(pieces):
        p = out.feed(piece, final=k == len(pieces) - 1)
        deltas += p.tool_calls
        content += p.content
    first = deltas[0]
    assert first["index"] == 0 and first["function"]["arguments"] == "" and first["type"] == "function"
    assert assemble_tool_calls(deltas) == [c.as_json() for c in whole.calls]
    assert (
        content == ""
        and out.finish_reason("stop") == "tool_calls"
        and out.finish_reason("length") == "length"
    )


def test_ids_are_the_same_on_a_replay_and_differ_between_requests() -> None:
    text = CASES[0][1]
    a, b = parse_tool_calls("hermes", text, "r1/0"), parse_tool_calls("hermes", text, "r1/0")
    c = parse_tool_calls("hermes", text, "r2/0")
    assert [x.id for x in a.calls] == [x.id for x in b.calls]
    assert not {x.id for x in a.calls} & {x.id for x in c.calls}
    assert all(x.id.startswith("call_") for x in a.calls)
    mistral = parse_tool_calls("mistral", CASES[12][1], "r1/0")
    assert all(len(x.id) == 9 and x.id.isalnum() for x in mistral.calls)  # Mistral's templates insist


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool parser"):
        tool_stream("xml")
