"""Each tool-call style (wsllm/server/chat/styles/): its parser on output text of its
family, parsed whole and streamed in random splits (the streamed pieces assemble to the
whole parse, a broken call comes back as content), its calls written into a prompt read
back as the same calls, and its constraint admitting exactly its calls."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from wsllm.server.chat.calls import Parsed, ToolStream
from wsllm.server.chat.output import ChoiceOutput, OutputOptions, assemble_tool_calls
from wsllm.server.chat.registry import STYLES, get_style
from wsllm.server.chat.style import call_schema
from wsllm.server.text import TextCodec

# The tools the cases' calls are typed by (a style that writes values bare reads them so).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }
    for name, props in {
        "get_weather": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "opts": {"type": "object"},
            "ratio": {"type": ["number", "null"]},
        },
        "write_file": {"path": {"type": "string"}, "content": {"type": "string"}},
    }.items()
]


def tool_stream(parser: str, id_seed: str = "") -> ToolStream:
    style = get_style(parser)
    return style.stream(id_seed, style.arg_types(TOOLS))


def parse_tool_calls(parser: str, text: str, id_seed: str = "") -> Parsed:
    return tool_stream(parser, id_seed).parse(text)


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
    (  # Qwen3-Coder: text, then two calls; values typed by the tools' schemas
        "qwen3_coder",
        "I'll check the weather and save it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "San Francisco, CA\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=detailed>\n"
        'true\n</parameter>\n<parameter=opts>\n{"units": ["C"], "n": null}\n</parameter>\n'
        "<parameter=ratio>\nnull\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=write_file>\n"
        '<parameter=path>\n007.txt\n</parameter>\n<parameter=content>\ndef f():\n    return "<b>"\n\n'
        "</parameter>\n</function>\n</tool_call>",
        "I'll check the weather and save it.",
        [
            (
                "get_weather",
                {
                    "city": "San Francisco, CA",
                    "days": 3,
                    "detailed": True,
                    "opts": {"units": ["C"], "n": None},
                }
                | {"ratio": None},
            ),
            ("write_file", {"path": "007.txt", "content": 'def f():\n    return "<b>"\n'}),
        ],
    ),
    (  # a value that does not fit its type stays text; a Python literal counts; an unknown
        # parameter is text; a call whose closing tag never came still counts
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=detailed>\n"
        "False\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>",
        "",
        [("get_weather", {"days": "three", "detailed": False, "extra": "42"})],
    ),
    (  # broken (no </function>) is content; the good call after it still counts
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>\n"
        "<tool_call>\n<function=g>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        [("g", {})],
    ),
    (  # cut by max_tokens inside a call: content
        "qwen3_coder",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [],
    ),
    ("qwen3_coder", "Use <function=x> in XML.\n", "Use <function=x> in XML.\n", []),
    (  # Llama 3.2 / 4, pythonic: two calls (vLLM's pythonic example)
        "pythonic",
        '[get_weather(city="San Francisco", metric="celsius"), get_weather(city="Seattle", metric="celsius")]',
        "",
        [
            ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            ("get_weather", {"city": "Seattle", "metric": "celsius"}),
        ],
    ),
    (  # Llama 4's tags, nested values, both quotes, JSON's names, a dotted name, text after
        "pythonic",
        "<|python_start|>[book(seats=[{'row': 3, 'ok': True}], note=None, q=\"Zürich ']' (x)\", "
        "n=-2.5, raw=true, none=null), tools.ping()]<|python_end|> Done.",
        "Done.",
        [
            (
                "book",
                {"seats": [{"row": 3, "ok": True}], "note": None, "q": "Zürich ']' (x)", "n": -2.5}
                | {"raw": True, "none": None},
            ),
            ("tools.ping", {}),
        ],
    ),
    ("pythonic", "[1] See the footnote.", "[1] See the footnote.", []),
    ("pythonic", "Sure: [f(x=1)]", "Sure: [f(x=1)]", []),  # the list must open the answer
    (  # not literals: nothing is looked up or run, the whole text is content
        "pythonic",
        '[get_weather(city=__import__("os").getcwd())]',
        '[get_weather(city=__import__("os").getcwd())]',
        [],
    ),
    ("pythonic", '[f("positional")]', '[f("positional")]', []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),  # cut by max_tokens
    (  # gpt-oss: reasoning, a preamble to the user, a call (the recipient in the role's part)
        "harmony",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Let me look.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
        '<|constrain|>json<|message|>{"city": "Oslo", "days": 2}<|call|>',
        "Let me look.",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (  # reasoning and the final answer; `<|return|>` ends it
        "harmony",
        "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>"
        "2 + 2 = 4.<|return|>",
        "2 + 2 = 4.",
        [],
    ),
    (  # broken: arguments that are no JSON object, then a header that is none
        "harmony",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Oslo}<|call|>"
        "<|start|>Hello, I am text.",
        "{city: Oslo}\nHello, I am text.",
        [],
    ),
    ("harmony", "Plain text, no channels.", "Plain text, no channels.", []),
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


def feed(parser: str, pieces: list[str]) -> Parsed:
    stream = tool_stream(parser, "req-1")
    out = Parsed()
    for piece in pieces:
        got = stream.feed(piece)
        out.content += got.content
        out.calls += got.calls
        out.reasoning += got.reasoning
    end = stream.finish()
    return Parsed(out.content + end.content, out.calls + end.calls, out.reasoning + end.reasoning)


def feed_in_pieces(parser: str, text: str, rng: random.Random) -> Parsed:
    cuts, i = [0], 0
    while i < len(text):
        i += rng.choice([0, 1, 1, 2, 3, 5, 8, 20])
        cuts.append(i)
    return feed(parser, [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])


@pytest.mark.parametrize(("parser", "text"), [(c[0], c[1]) for c in CASES])
def test_streamed_in_two_pieces_cut_anywhere_or_by_the_character_equals_the_whole_parse(
    parser: str, text: str
) -> None:
    whole = parse_tool_calls(parser, text, "req-1")
    for i in range(len(text) + 1):
        assert feed(parser, [text[:i], text[i:]]) == whole, i
    assert feed(parser, list(text)) == whole


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


def test_every_style_has_cases() -> None:
    assert {c[0] for c in CASES} == set(STYLES)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("parser", list(STYLES))
def test_calls_written_into_a_prompt_read_back_as_the_same_calls(parser: str) -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        {"id": "c", "type": "function", "function": {"name": "write_file", "arguments": {"path": "a.txt"}}},
    ]
    parsed = parse_tool_calls(parser, get_style(parser).render_calls(calls))
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
        ("write_file", {"path": "a.txt"}),
    ]


def test_call_schema_accepts_what_the_parser_reads_and_nothing_else() -> None:
    tools = [WEATHER, TIME]
    schema = call_schema(tools, "arguments")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for bad in (
        {"name": "get_weather", "arguments": {}},
        {"name": "other", "arguments": {}},
        {"name": "get_time"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    llama = call_schema(tools, "parameters", only="get_time")
    jsonschema.validate({"name": "get_time", "parameters": {}}, llama)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"city": "x"}}, llama)


# Outputs each style's constraint must allow, read back by that style's parser. The
# grammars inside Lark write compact JSON (a model must not pad a call with whitespace).
FORCED_OUTPUTS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}; {"name":"get_time","parameters":{}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "pythonic": '[get_weather(city="Oslo", unit="C"), get_time()]',
    # over the special tokens (the parallel calls where <|call|> is no stop token)
    "harmony": "<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|><|start|>assistant'
    "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
}


@pytest.fixture(scope="module")
def codecs(smollm_dir: Path, tiny_harmony_dir: Path) -> dict[str, TextCodec]:
    """SmolLM2's tokenizer; harmony's constraint needs its special tokens (gpt-oss's shape)."""
    return {"": TextCodec(str(smollm_dir)), "harmony": TextCodec(str(tiny_harmony_dir))}


@pytest.mark.parametrize("parser", list(STYLES))
def test_the_constraint_holds_exactly_the_parser_s_calls(codecs: dict[str, TextCodec], parser: str) -> None:
    """With llguidance (the structured-output backend): the constraint compiles,
    accepts two calls in the style (which the parser reads back), and refuses prose."""
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    codec = codecs.get(parser, codecs[""])
    tok = hf.from_tokenizer(codec.hf)
    text = FORCED_OUTPUTS[parser]
    assert len(parse_tool_calls(parser, text).calls) == 2

    def matcher(structured: dict[str, Any]) -> Any:
        ((kind, value),) = structured.items()
        grammar = llguidance.grammar_from(
            "json_schema" if kind == "json" else "lark", value if kind == "grammar" else json.dumps(value)
        )
        m = llguidance.LLMatcher(tok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def accepts(structured: dict[str, Any], out: str) -> bool:
        m = matcher(structured)
        ok = m.consume_tokens(codec.backend.encode(out, add_special_tokens=False).ids)
        return bool(ok) and not m.is_error() and m.is_accepting()

    style, tools = get_style(parser), [WEATHER, TIME]
    assert accepts(style.constraint(tools, "", parallel=True), text)
    assert not accepts(style.constraint(tools, "", parallel=False), text)  # one call only
    assert not accepts(style.constraint(tools, "get_time", parallel=True), text)  # the named one only
    assert not accepts(style.constraint(tools, "", parallel=True), "The weather is nice.")
