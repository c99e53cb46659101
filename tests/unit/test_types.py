"""The wire types: every numeric field has bounds on both sides, and decoding is
strict, so that a bad entry names its field and costs only its own request."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from wsllm.bounds import MAX_TOP_K, MAX_WIRE_IMAGES, SAMPLING_BOUNDS
from wsllm.types import (
    GREEDY_BELOW,
    GenerateRequest,
    PromptImage,
    SamplingParams,
    TokenEvent,
    Usage,
    WireError,
)
from wsllm.wire import check_request, decode_events, decode_request, encode


def good() -> GenerateRequest:
    params = SamplingParams(n=2, top_k=5, seed=3, stop_token_ids=[4], logprobs=1)
    return GenerateRequest("r1", [1, 2, 3], params, model="m", arrival_time=time.time())


def test_requests_and_events_survive_the_wire() -> None:
    req = good()
    assert decode_request(encode(req)) == req
    events = [
        TokenEvent("r1", 0, [5], logprobs=[[-0.1, [[5, -0.1]]]], queue_time=0.01),
        TokenEvent("r1", 1, [6], 0, "length", usage=Usage(3, 2, 1)),
        TokenEvent.lost("r1", "gone"),
        TokenEvent.abort_marker("r1"),
    ]
    assert decode_events(encode(events)) == events


def test_structured_and_logit_bias_survive_the_wire() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for structured in ({"json": schema}, {"json": True}, {"regex": "[0-9]+"}, {"choice": ["a", "b"]}):
        params = SamplingParams(structured=structured, logit_bias={50256: -100.0, 7: 2.5})
        req = GenerateRequest("r1", [1, 2], params)
        back = decode_request(encode(req))
        assert back == req
        assert back.params.logit_bias == {50256: -100.0, 7: 2.5}  # integer keys again
        assert check_request(req) == req


def test_prompt_logprobs_cross_the_wire_and_stay_off_it_when_unset() -> None:
    req = good()
    req.params.prompt_logprobs = 2
    assert decode_request(encode(req)) == req
    plps = [None, [-1.5, [[7, -0.5], [3, -1.5]]], [-0.25, [[9, -0.25], [4, -2.0]]]]
    ev = TokenEvent("r1", 0, [5], prompt_logprobs=plps)
    assert decode_events(encode([ev])) == [ev]
    # unset, the new fields are not written: an engine or gateway from before them reads
    # these messages (its decoder forbids unknown fields)
    plain_req, plain_ev = orjson.loads(encode(good())), orjson.loads(encode([TokenEvent("r1", 0, [5])]))
    assert "prompt_logprobs" not in plain_req["item"]["params"]
    assert "prompt_logprobs" not in plain_ev["items"][0]
    assert decode_request(encode(good())).params.prompt_logprobs is None


# (what the issue saw or a neighbour of it, the field the error must name)
FIELD_CASES: list[tuple[dict[str, Any], str]] = [
    ({"top_k": 18446744073709551615}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": MAX_TOP_K + 1}, "top_k"),
    ({"temperature": -1e-9}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"n": 0}, "n"),
    ({"n": 10**6}, "n"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"beam_width": 17}, "beam_width"),
    ({"length_penalty": 1e9}, "length_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(
    ("fields", "name"), FIELD_CASES, ids=[f"{k}={v!r:.20}" for (f, _) in FIELD_CASES for k, v in f.items()]
)
def test_every_numeric_field_is_bounded_on_both_sides(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_every_number_of_sampling_params_has_one_declared_bound() -> None:
    numbers = {f for f, t in SamplingParams.__annotations__.items() if "int" in t or "float" in t}
    assert set(SAMPLING_BOUNDS) == numbers


def edges(name: str) -> tuple[list[Any], list[Any]]:
    """Values a field's declared bound lets in, and the nearest ones it keeps out."""
    b = SAMPLING_BOUNDS[name]
    step = 1 if b.integer else 1e-9
    lo_in, hi_in = (b.lo + step if b.lo_open else b.lo), (b.hi - step if b.hi_open else b.hi)
    inside, outside = [lo_in, hi_in], [b.hi + step if not b.hi_open else b.hi]
    outside.append(b.lo if b.lo_open else b.lo - step)
    if b.integer:
        inside, outside = [int(v) for v in inside], [int(v) for v in outside]
    if b.off is not None:  # top_k: -1 is off, 0 is out, as is anything below -1
        inside.append(b.off)
        outside.append(b.off - 1)
    if b.items is not None:
        key = (lambda v: {7: v}) if b.keyed else (lambda v: [v])
        inside, outside = [key(v) for v in inside], [key(v) for v in outside]
    return inside, outside


@pytest.mark.parametrize("name", sorted(SAMPLING_BOUNDS))
def test_sampling_params_take_exactly_their_declared_bounds(name: str) -> None:
    inside, outside = edges(name)
    base = {"max_tokens": 2**20} if name == "min_tokens" else {}
    for v in inside:
        assert getattr(SamplingParams(**base, **{name: v}), name) == v
    for v in outside:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**base, **{name: v})


def test_a_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def mutated(change: Any, base: GenerateRequest | None = None) -> bytes:
    msg = orjson.loads(encode(base or good()))
    change(msg)
    return orjson.dumps(msg)


IMAGE = PromptImage.of(b"GIF89a" + bytes(40), "0f" * 32, 1, 2)


def pictured() -> GenerateRequest:
    """A request with an image whose placeholders are prompt positions 1 and 2."""
    req = good()
    req.images = [IMAGE]
    return req


def with_image(**change: Any) -> Any:
    return lambda m: m["item"]["images"][0].update(change)


def test_an_image_crosses_the_wire_whole() -> None:
    sent = pictured()
    back = decode_request(encode(sent))
    assert back == sent and back.images[0].file() == b"GIF89a" + bytes(40)
    assert back.images[0].file_bytes == 46
    assert check_request(sent) == sent


BAD_ENTRIES: list[tuple[str, bytes, str]] = [
    (
        "prompt_token_ids is a number",
        mutated(lambda m: m["item"].update(prompt_token_ids=5)),
        "prompt_token_ids",
    ),
    ("arrival_time is text", mutated(lambda m: m["item"].update(arrival_time="x")), "arrival_time"),
    ("top_k overflows", mutated(lambda m: m["item"]["params"].update(top_k=2**64 - 1)), "top_k"),
    ("a bool token id", mutated(lambda m: m["item"].update(prompt_token_ids=[1, True])), "prompt_token_ids"),
    ("a negative token id", mutated(lambda m: m["item"].update(prompt_token_ids=[-1])), "prompt_token_ids"),
    ("an empty prompt", mutated(lambda m: m["item"].update(prompt_token_ids=[])), "prompt_token_ids"),
    ("an integer as a float", mutated(lambda m: m["item"]["params"].update(n=1.0)), "n"),
    ("an unknown field", mutated(lambda m: m["item"].update(evil=1)), "evil"),
    ("no params", mutated(lambda m: m["item"].pop("params")), "params"),
    ("another schema version", mutated(lambda m: m.update(v=2)), "v"),
    (
        "a bias key that is no id",
        mutated(lambda m: m["item"]["params"].update(logit_bias={"x": 1})),
        "logit_bias",
    ),
    ("a bias past 100", mutated(lambda m: m["item"]["params"].update(logit_bias={"5": 101})), "logit_bias"),
    (
        "a structured kind unknown",
        mutated(lambda m: m["item"]["params"].update(structured={"xml": "a"})),
        "structured",
    ),
    (
        "a regex that is no string",
        mutated(lambda m: m["item"]["params"].update(structured={"regex": 5})),
        "structured",
    ),
    ("an image's span past the prompt", mutated(with_image(length=3), pictured()), "images.0"),
    ("an image's digest no hex", mutated(with_image(digest="Z" * 64), pictured()), "digest"),
    ("an image's data no base64", mutated(with_image(data="****"), pictured()), "data"),
    ("an image's data a list", mutated(with_image(data=[1]), pictured()), "data"),
    ("an image without a span", mutated(with_image(length=0), pictured()), "length"),
    (
        "two images overlapping",
        mutated(lambda m: m["item"]["images"].append(dict(m["item"]["images"][0])), pictured()),
        "images.1",
    ),
    (
        "too many images",
        mutated(
            lambda m: m["item"].update(images=[m["item"]["images"][0]] * (MAX_WIRE_IMAGES + 1)), pictured()
        ),
        "images",
    ),
    ("an event batch", encode([TokenEvent("r1", 0, [1])]), "kind"),
    ("not JSON", b"\xff garbage", "request"),
    ("a list", b"[1, 2]", "request"),
    ("NaN", encode(good()).replace(b'"temperature":1.0', b'"temperature":NaN'), "temperature"),
]


@pytest.mark.parametrize(("case", "data", "name"), BAD_ENTRIES, ids=[c[0] for c in BAD_ENTRIES])
def test_decoding_is_strict_and_names_the_field(case: str, data: bytes, name: str) -> None:
    with pytest.raises(WireError, match=name):
        decode_request(data)


def test_events_are_checked_too() -> None:
    bad = orjson.dumps(
        {"v": 1, "kind": "events", "items": [{"request_id": "r", "seq": "0", "token_ids": []}]}
    )
    with pytest.raises(WireError, match="seq"):
        decode_events(bad)
    with pytest.raises(WireError):
        decode_events(orjson.dumps({"v": 1, "kind": "events", "items": [{"request_id": "r"}]}))


def test_an_in_process_request_is_checked_like_a_decoded_one() -> None:
    req = good()
    assert check_request(req) == req
    req.params.top_k = 2**64 - 1  # changed after it was built: the engine must not trust it
    with pytest.raises(WireError, match="top_k"):
        check_request(req)
    with pytest.raises(WireError):
        check_request({"request_id": "r1"})
