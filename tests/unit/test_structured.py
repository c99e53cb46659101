"""Structured output and logit_bias on a tiny random-weight model: whatever the model
prefers, what comes back matches the schema / regex / choice / grammar, through forks,
preemption and aborts; a bad spec is a clear ValueError; logit_bias forces and bans."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis_jsonschema import from_schema

from wsllm.bounds import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS
from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.outputs import RequestOutput
from wsllm.structured import Matchers, check_spec
from wsllm.types import GenerateRequest, SamplingParams

PROMPT = [1, 504, 3456, 77, 9012]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_gb=0.05, max_num_seqs=64)
    engine = LLMEngine.from_config(cfg)
    engine.matchers.warm()  # as the servers do: the first structured request joins the build
    return engine


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run(engine: LLMEngine, params: list[SamplingParams], prompt: list[int] = PROMPT) -> list[RequestOutput]:
    """Every request at once; the final output of each, in order."""
    for i, p in enumerate(params):
        engine.add_request(GenerateRequest(f"s{i}", prompt, p))
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[f"s{i}"] for i in range(len(params))]


def texts(tokenizer: Any, out: RequestOutput) -> list[str]:
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out.outputs]


# -- schemas drawn by hypothesis-jsonschema ------------------------------------------------
# hypothesis-jsonschema 0.23 draws JSON objects through a Hypothesis internal that recent
# Hypothesis removed, so the schemas are drawn as arrays (tuples: ["string", 0, 5]) and
# spelled out as JSON schemas below. Bounds come from ranges that cannot cross (minLength
# <= 3 <= maxLength), so every schema is satisfiable; objects require every property they
# name and allow no other, so every instance is finite.


def _tuple(*items: Any) -> dict[str, Any]:
    return {"type": "array", "items": list(items), "minItems": len(items), "additionalItems": False}


def _ints(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _leaf() -> dict[str, Any]:
    # enum members a tokenizer can write (plain words) and integers of 64 bits at most
    # (llguidance's range), while hypothesis would draw any string and any size
    word = {"type": "string", "pattern": "^[a-z ]{0,8}$"}
    scalar = {"anyOf": [word, {"type": ["boolean", "null"]}, _ints(-(10**6), 10**6)]}
    return {
        "anyOf": [
            _tuple({"const": "string"}, _ints(0, 3), _ints(3, 10)),
            _tuple({"const": "integer"}, _ints(-1000, 0), _ints(0, 1000)),
            _tuple({"const": "number"}, _ints(-50, 0), _ints(0, 50)),
            _tuple({"enum": ["boolean", "null"]}),
            _tuple({"const": "enum"}, {"type": "array", "items": scalar, "minItems": 1, "maxItems": 4}),
        ]
    }


def _containers(inner: dict[str, Any]) -> list[dict[str, Any]]:
    name = {"type": "string", "pattern": "^[a-z_]{1,8}$"}
    members = {"type": "array", "items": _tuple(name, inner), "minItems": 1, "maxItems": 3}
    return [_tuple({"const": "array"}, inner, _ints(0, 2), _ints(2, 4)), _tuple({"const": "object"}, members)]


SCHEMA_CODES = {"anyOf": [_leaf(), *_containers({"anyOf": [_leaf(), *_containers(_leaf())]})]}


def to_schema(code: list[Any]) -> dict[str, Any]:
    """["object", [["a", ["integer", -5, 9]]]] -> {"type": "object", "properties": ...}"""
    kind, *args = code
    if kind in ("string", "array"):
        lo, hi = args[-2:]
        key = "Length" if kind == "string" else "Items"
        out: dict[str, Any] = {"type": kind, f"min{key}": lo, f"max{key}": hi}
        if kind == "array":
            out["items"] = to_schema(args[0])
        return out
    if kind in ("integer", "number"):
        return {"type": kind, "minimum": args[0], "maximum": args[1]}
    if kind == "enum":
        return {"enum": args[0]}
    if kind == "object":
        props = {n: to_schema(c) for n, c in args[0]}
        return {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    return {"type": kind}


def drawn_schemas(n: int) -> list[dict[str, Any]]:
    """n schemas, the same every run (derandomized)."""
    found: list[dict[str, Any]] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(from_schema(SCHEMA_CODES))
    def collect(code: list[Any]) -> None:
        found.append(to_schema(code))

    collect()
    return found


def closers(tokenizer: Any) -> dict[int, float]:
    """A bias toward ending things: the model would close every string, array and object
    at once and stop; only the grammar holds it to minLength, minItems, required keys."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "}", "]", "<|im_end|>")]
    return {i: 4.0 for i in ids}


def test_outputs_validate_against_fifty_drawn_schemas(engine: LLMEngine, tokenizer: Any) -> None:
    schemas = drawn_schemas(50)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) >= 30, "the draws vary"
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
        check_spec({"json": s})  # every drawn schema is one llguidance supports
    bias = closers(tokenizer)
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=1.0,
            seed=i,
            structured={"json": s},
            logit_bias=bias if i % 2 else None,
        )
        for i, s in enumerate(schemas)
    ]
    outs = run(engine, params)
    for schema, out in zip(schemas, outs, strict=True):
        (text,) = texts(tokenizer, out)
        assert out.outputs[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_regex_and_choice_outputs_match(engine: LLMEngine, tokenizer: Any) -> None:
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["no", "not sure", "yes", 'a "quoted" answer', "été"]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured={"regex": regex}) for i in range(6)
    ]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured={"choice": choices}) for i in range(6)]  # fmt: skip
    params.append(SamplingParams(max_tokens=40, temperature=0.0, structured={"choice": choices}))
    outs = run(engine, params)
    for out in outs[:6]:
        assert re.fullmatch(regex, texts(tokenizer, out)[0]), texts(tokenizer, out)
        assert out.outputs[0].finish_reason == "stop"
    for out in outs[6:]:
        assert texts(tokenizer, out)[0] in choices
        assert out.outputs[0].finish_reason == "stop"


def test_a_grammar_in_lark_or_gbnf(engine: LLMEngine, tokenizer: Any) -> None:
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
    outs = run(
        engine,
        [
            SamplingParams(
                max_tokens=30,
                temperature=1.0,
                seed=1,
                structured={"grammar": lark},
                logit_bias=closers(tokenizer) | {tokenizer.convert_tokens_to_ids(")"): 6.0},
            ),  # fmt: skip
            SamplingParams(max_tokens=30, temperature=1.0, seed=2, structured={"grammar": gbnf}),
        ],
    )
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts(tokenizer, outs[0])[0])
    assert re.fullmatch(r"x=[0-9]{1,2};", texts(tokenizer, outs[1])[0])


OBJECT = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}  # fmt: skip


def test_n_choices_fork_with_their_own_matchers(engine: LLMEngine, tokenizer: Any) -> None:
    params = SamplingParams(
        n=3,
        max_tokens=60,
        temperature=1.0,
        seed=5,
        structured={"json": OBJECT},
        logit_bias=closers(tokenizer),
    )
    (out,) = run(engine, [params])
    got = [json.loads(t) for t in texts(tokenizer, out)]
    for value in got:
        jsonschema.validate(value, OBJECT)
    assert len({json.dumps(v) for v in got}) > 1, "each choice samples on its own"
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3


def test_a_preempted_structured_sequence_stays_valid(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Recompute preemption drops the KV, not the tokens: the matcher, which has consumed
    exactly the output tokens, carries on where it was."""
    small = LLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", num_kv_blocks=20, preemption_mode="recompute"
        )
    )
    regex = r"[0-9]{3}(-[a-z]{3}){10}"
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured={"regex": regex}) for i in range(8)
    ]
    prompts = [[1] + [100 + 37 * i + j for j in range(10 + 5 * i)] for i in range(8)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        small.add_request(GenerateRequest(f"p{i}", prompt, p))
    final: dict[str, RequestOutput] = {}
    while small.has_unfinished():
        for o in small.step():
            if o.finished:
                final[o.request_id] = o
    assert small.stats().num_preemptions > 0
    for out in final.values():
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, texts(tokenizer, out)[0]), texts(tokenizer, out)
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_abort_frees_the_blocks_and_the_matcher(engine: LLMEngine) -> None:
    bm = engine.block_manager
    free0 = bm.num_free_blocks
    engine.add_request(
        GenerateRequest(
            "a", PROMPT * 8, SamplingParams(n=2, max_tokens=200, structured={"regex": "[a-z]{500}"})
        )
    )
    for _ in range(3):
        engine.step()
    seqs = [s for s in engine.scheduler.running if s.request_id == "a"]
    assert len(seqs) == 2 and all(s.matcher is not None for s in seqs)
    assert engine.abort("a")
    assert all(s.matcher is None for s in seqs)
    (out,) = [o for o in engine.step() if o.request_id == "a"]
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert bm.num_free_blocks == free0
    bm.check_invariants()


def test_a_matcher_that_fails_mid_request_ends_only_that_request(engine: LLMEngine) -> None:
    engine.add_request(
        GenerateRequest("bad", PROMPT, SamplingParams(max_tokens=20, structured={"regex": "[0-9]+"}))
    )
    engine.add_request(
        GenerateRequest("good", PROMPT, SamplingParams(max_tokens=20, structured={"regex": "[0-9]{20}"}))
    )
    engine.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == "bad"]
    seq.matcher.consume_token(PROMPT[1])  # a token its grammar refuses: an error state, as a bug would
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["bad"].error_code == "invalid_request"
    assert outs["bad"].error is not None and "structured output failed" in outs["bad"].error
    assert outs["good"].error is None and outs["good"].outputs[0].finish_reason == "stop"
    assert len(outs["good"].outputs[0].token_ids) >= 20
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"json": {"type": "strng"}}, r"structured\.json: Invalid type: strng"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, r"structured\.json: Unsatisfiable"),
    ({"json": {"not": {"type": "string"}}}, r"structured\.json: Unimplemented keys: \[\"not\"\]"),
    ({"json": {"$ref": "#/$defs/missing"}}, r"structured\.json: .*missing"),
    ({"regex": "[a-z"}, r"structured\.regex: .*unclosed character class"),
    ({"grammar": "start: item\n"}, r"structured\.grammar: .*unknown name: \"item\""),
    ({"grammar": "root ::= ("}, r"structured\.grammar: .*GBNF"),
]


@pytest.mark.parametrize(("spec", "match"), BAD_SPECS, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_SPECS)])  # fmt: skip
def test_a_bad_spec_is_a_clear_value_error(engine: LLMEngine, spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match="(?s)" + match):
        check_spec(spec)
    before = (len(engine._requests), engine.block_manager.num_free_blocks)
    # the engine compiles again, off its step thread: the request ends with the error
    engine.add_request(GenerateRequest("x", PROMPT, SamplingParams(structured=spec)))
    outs = [o for _ in range(500) if engine.has_unfinished() for o in engine.step()]
    assert [(o.request_id, o.error_code) for o in outs] == [("x", "invalid_request")]
    assert re.search("(?s)" + match, outs[0].error or "")
    assert (len(engine._requests), engine.block_manager.num_free_blocks) == before


def test_a_model_whose_tokenizer_llguidance_cannot_read_fails_its_structured_requests(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # no tokenizer here
    matchers = Matchers(tmp_path, 100, [0])
    matchers.warm()  # the error is kept, not raised on the warming thread
    for _ in range(2):  # and said again to every request, without a second try
        with pytest.raises(ValueError, match="structured output is not available for this model"):
            matchers.new({"regex": "a+"})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"structured": {"jsonschema": {}}}, "structured must be an object with exactly one key"),
        ({"structured": {"json": {}, "regex": "a"}}, "exactly one key"),
        ({"structured": {"json": 3}}, "structured.json must be a JSON schema object or true"),
        ({"structured": {"json": {1: "x"}}}, "structured.json must be plain JSON"),
        ({"structured": {"regex": ""}}, "structured.regex must be a non-empty string"),
        ({"structured": {"choice": []}}, "structured.choice must be a list of 1 to"),
        ({"structured": {"choice": ["a", 3]}}, "structured.choice"),
        ({"structured": {"grammar": "x" * (1 << 18)}}, "structured.grammar must be at most"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"use_beam_search": True, "beam_width": 2, "structured": {"regex": "a"}}, "use_beam_search"),
    ],
)
def test_sampling_params_check_the_shapes(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_both_ways_of_unpacking_a_mask_agree() -> None:
    """The CPU unpacks masks with numpy, a GPU with torch ops on the device."""
    import numpy as np
    import torch

    from wsllm.engine.logits_processors import unpack_bits_numpy, unpack_bits_torch

    words = np.random.default_rng(0).integers(-(2**31), 2**31, size=(3, 5), dtype=np.int32)
    words[0, 0] = 0b101  # tokens 0 and 2
    a = unpack_bits_numpy(words, 150)
    assert a.shape == (3, 150) and a[0, :3].tolist() == [True, False, True]
    assert torch.equal(a, unpack_bits_torch(torch.from_numpy(words), 150))


def test_logit_bias_forces_and_bans_tokens(engine: LLMEngine) -> None:
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (plain,) = run(engine, [free])
    first = plain.outputs[0].token_ids[0]
    forced_tok, banned = 4321, {t: -LOGIT_BIAS_LIMIT for t in set(plain.outputs[0].token_ids)}
    outs = run(
        engine,
        [
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={forced_tok: 100.0}),
            SamplingParams(
                max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, logit_bias={forced_tok: 100.0}
            ),  # fmt: skip
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias=banned),
            SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0}, logprobs=5
            ),  # fmt: skip
        ],
    )
    assert outs[0].outputs[0].token_ids == [forced_tok] * 8
    assert outs[1].outputs[0].token_ids == [forced_tok] * 8
    assert not set(outs[2].outputs[0].token_ids) & set(banned)
    assert outs[3].outputs[0].token_ids[0] != first
    with pytest.raises(ValueError, match="logit_bias token ids"):
        engine.add_request(GenerateRequest("x", PROMPT, SamplingParams(logit_bias={engine.vocab_size: 1.0})))


def test_a_grammar_overrules_logit_bias_and_logprobs_list_only_allowed_tokens(
    engine: LLMEngine, tokenizer: Any
) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    params = SamplingParams(
        max_tokens=10, temperature=0.0, logprobs=5, structured={"regex": "[0-9]{4}"}, logit_bias={eos: 100.0}
    )
    engine.add_request(GenerateRequest("lp", PROMPT, params))
    got: list[Any] = []
    while engine.has_unfinished():
        for o in engine.step():
            got += o.outputs[0].new_logprobs or []
            if o.finished:
                final = o
    assert re.fullmatch("[0-9]{4}", texts(tokenizer, final)[0])
    assert len(got) == 4 and final.outputs[0].finish_reason == "stop"
    for chosen, top in got:
        assert {t for t, _ in top} <= digits, "only what the grammar allows is listed"
        assert sum(2.718281828459045**lp for _, lp in top) <= 1.0 + 1e-4
        assert chosen <= 0.0
