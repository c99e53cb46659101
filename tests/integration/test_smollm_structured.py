"""Issue 13's acceptance on the real SmolLM2 (greedy): the `openai` client's `parse()`
returns objects of five Pydantic models, regex and choice hold, a required tool call
follows its function's schema and a tool result continues the conversation, and a
`<think>` block forced with `logit_bias` comes back as `reasoning_content`.

The random-weight versions (tests/integration/test_structured_api.py, test_tools_api.py)
show the constraint alone makes outputs valid; these show a real model gets answers
that end by themselves, well within `max_tokens`."""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import orjson
import pytest
import websockets
from pydantic import BaseModel, Field

from wsllm.server.chat.output import assemble_tool_calls
from wsllm.server.chat.reasoning import ThinkSplitter

# Strings and lists are bounded so that every answer ends well within MAX_TOKENS.
MAX_TOKENS = 400


class Size(enum.Enum):
    small = "small"
    large = "large"


class District(BaseModel):
    name: str = Field(max_length=12)
    size: Size


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=50_000_000)
    districts: list[District] = Field(min_length=1, max_length=2)
    capital: bool


class Difficulty(enum.Enum):
    easy = "easy"
    medium = "medium"
    hard = "hard"


class Ingredient(BaseModel):
    name: str = Field(max_length=12)
    grams: float = Field(ge=1, le=1000)


class Recipe(BaseModel):
    title: str = Field(max_length=20)
    servings: int = Field(ge=1, le=8)
    difficulty: Difficulty
    ingredients: list[Ingredient] = Field(min_length=1, max_length=3)


class Address(BaseModel):
    street: str = Field(max_length=20)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    hobbies: list[str] = Field(max_length=3)  # a list of bounded strings
    address: Address


class Day(enum.Enum):
    monday = "monday"
    tuesday = "tuesday"
    wednesday = "wednesday"


class DayForecast(BaseModel):
    day: Day
    high_c: float = Field(ge=-50, le=60)
    rain: bool


class Forecast(BaseModel):
    city: str = Field(max_length=16)
    days: list[DayForecast] = Field(min_length=1, max_length=3)


class Genre(enum.Enum):
    fiction = "fiction"
    science = "science"
    history = "history"


class Author(BaseModel):
    name: str = Field(max_length=20)
    born: int = Field(ge=1000, le=2025)


class Book(BaseModel):
    title: str = Field(max_length=24)
    author: Author
    genres: list[Genre] = Field(min_length=1, max_length=2)
    rating: float = Field(ge=0, le=5)
    in_print: bool


PARSE_CASES: dict[str, tuple[type[BaseModel], str]] = {
    "city": (City, "Describe Paris as JSON."),
    "recipe": (Recipe, "Give me a simple pancake recipe as JSON."),
    "person": (Person, "Invent a person with an address and hobbies, as JSON."),
    "forecast": (Forecast, "Give a weather forecast for London as JSON."),
    "book": (Book, "Describe a famous novel as JSON."),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def srv(live_server: Any, smollm_engine: Any) -> Iterator[Any]:
    with live_server(smollm_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def parsed(srv: Any, client: openai.OpenAI) -> dict[str, Any]:
    """All five parse() calls at once (one batch in the engine: cheaper than in turn)."""

    def parse(case: str) -> Any:
        model, prompt = PARSE_CASES[case]
        return client.beta.chat.completions.parse(
            model=srv.gateway.model_name,
            messages=[{"role": "user", "content": prompt}],
            response_format=model,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )

    with ThreadPoolExecutor(len(PARSE_CASES)) as pool:
        return dict(zip(PARSE_CASES, pool.map(parse, PARSE_CASES), strict=True))


@pytest.mark.parametrize("case", list(PARSE_CASES))
def test_parse_returns_an_object_of_the_pydantic_model(parsed: dict[str, Any], case: str) -> None:
    model = PARSE_CASES[case][0]
    choice = parsed[case].choices[0]
    assert choice.finish_reason == "stop", choice  # the object ended, not max_tokens
    assert isinstance(choice.message.parsed, model), choice.message.content
    jsonschema.validate(orjson.loads(choice.message.content or ""), model.model_json_schema())


def test_regex_and_choice_hold(srv: Any, client: openai.OpenAI) -> None:
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r = client.completions.create(
        model=srv.gateway.model_name,
        prompt="The first moon landing, as an ISO date:",
        extra_body={"structured_outputs": {"regex": date}},
        max_tokens=20,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(date, r.choices[0].text), r.choices[0]
    options = ["yes", "no", "maybe later"]
    c = client.chat.completions.create(
        model=srv.gateway.model_name,
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        extra_body={"structured_outputs": {"choice": options}},
        max_tokens=10,
        temperature=0,
    )
    assert c.choices[0].finish_reason == "stop" and c.choices[0].message.content in options, c.choices[0]


def _create(client: openai.OpenAI, srv: Any, **kw: Any) -> Any:
    return client.chat.completions.create(model=srv.gateway.model_name, temperature=0, **kw)


def test_a_required_tool_call_round_trip(srv: Any, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=200)
    r = _create(client, srv, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls, choice.message
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(orjson.loads(call.function.arguments), schemas[call.function.name])

    deltas = [
        tc.model_dump(exclude_none=True)
        for chunk in _create(client, srv, **kw, stream=True)
        for ch in chunk.choices
        for tc in ch.delta.tool_calls or []
    ]
    streamed = assemble_tool_calls(deltas)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]

    # The agent runs the function and sends its result back: the model answers in text.
    made = [c.model_dump(include={"id", "type", "function"}) for c in calls]
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": '{"temp_c": 18, "sky": "sunny"}'} for c in calls
    ]
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": made}] + results
    answer = _create(client, srv, messages=history, tools=TOOLS, max_tokens=48).choices[0]
    assert answer.message.role == "assistant" and answer.finish_reason in ("stop", "length"), answer
    assert answer.message.content and not answer.message.tool_calls, answer.message


# The text the model is made to write: `<think>` and `</think>` are each three tokens
# of SmolLM2 ('<' 'think' '>' and '</' 'think' '>'), so the splitter must hold the tag
# back across deltas.
THOUGHT, ANSWER = "sky blue", "Yes"
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"


def _forcing_request(srv: Any) -> dict[str, Any]:
    """A chat request whose greedy answer is FORCED, by logit_bias alone: +100 on exactly
    FORCED's tokens and EOS makes the answer a sequence of them; which order the model
    picks is its own choice, so an earlier turn shows it FORCED and the model copies it
    (without the bias it answers in words of its own; see the test)."""
    codec = srv.gateway.codec
    ids = codec.hf.encode(FORCED, add_special_tokens=False)
    eos = codec.hf.convert_tokens_to_ids(codec.hf.eos_token)
    return dict(
        messages=[
            {"role": "user", "content": "Is the sky blue?"},
            {"role": "assistant", "content": FORCED},
            {"role": "user", "content": "Is the sky blue? Say it again."},
        ],
        logit_bias={str(t): 100 for t in {*ids, eos}},
        max_tokens=24,
    )


def test_the_tags_are_several_tokens_and_the_splitter_holds_them(srv: Any) -> None:
    hf = srv.gateway.codec.hf
    pieces = [hf.decode([t]) for t in hf.encode(FORCED, add_special_tokens=False)]
    assert pieces[:3] == ["<", "think", ">"] and pieces[-4:-1] == ["</", "think", ">"], pieces
    splitter = ThinkSplitter()
    out = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    assert "".join(r for r, _ in out) == THOUGHT and "".join(c for _, c in out) == ANSWER


def test_a_think_block_forced_by_logit_bias_is_reasoning_streamed_and_not(
    srv: Any, client: openai.OpenAI
) -> None:
    req = _forcing_request(srv)
    free = _create(client, srv, **(req | {"logit_bias": None})).choices[0].message
    assert "<think>" not in (free.content or "") and not (free.model_extra or {}).get("reasoning_content")

    r = _create(client, srv, **req).choices[0]
    assert r.finish_reason == "stop", r
    assert (r.message.model_extra or {}).get("reasoning_content") == THOUGHT, r.message
    assert r.message.content == ANSWER

    reasoning, content = [], []
    for chunk in _create(client, srv, **req, stream=True):
        for ch in chunk.choices:
            reasoning.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(ch.delta.content or "")
    assert "".join(reasoning) == THOUGHT and "".join(content) == ANSWER, (reasoning, content)
    assert sum(bool(p) for p in reasoning) > 1  # it came token by token, not in one piece

    async def ws() -> list[dict[str, Any]]:
        async with websockets.connect(srv.ws_url) as sock:
            await sock.recv()  # hello
            await sock.send(orjson.dumps({"type": "chat", "id": "r", "temperature": 0} | req).decode())
            got = [orjson.loads(await sock.recv())]
            while got[-1]["type"] not in ("done", "error"):
                got.append(orjson.loads(await sock.recv()))
            return got

    got = asyncio.run(ws())
    assert got[-1]["type"] == "done" and got[-1]["finish_reason"] == "stop", got[-1]
    assert "".join(m["text"] for m in got if m["type"] == "reasoning") == THOUGHT
    assert "".join(m["text"] for m in got if m["type"] == "delta") == ANSWER
