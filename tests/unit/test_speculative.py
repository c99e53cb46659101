"""Speculative decoding (wsllm/engine/speculative/): exact. Greedy and seeded output is token
for token (and logprob for logprob) what it is without speculation, with either proposer, in
mixed batches with prefix hits, n > 1, penalties, stop tokens, structured output and
preemption by recompute and by swap; sampled output keeps the target's distribution; a draft
model equal to the target has every draft accepted; the cost model drafts where a step's row
is cheap and not where it costs what a token is worth."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from wsllm.kernels.sampling import kept_probs

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.sampler import Sampler, row_views
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative.policy import choose
from wsllm.engine.step_cost import DecodeRows
from wsllm.types import GenerateRequest, SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
LOOPING = [1, 504, 3456, 77, 504, 3456, 77, 504]  # the tiny models repeat themselves: drafts get accepted


def make(model: Path, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = {"dtype": "float32", "kv_cache_gb": 0.05} | kw
    return LLMEngine.from_config(EngineConfig(model=str(model), **cfg))


def serve(engine: LLMEngine, plan: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, Any]:
    """Add each request at its step; every choice's tokens and logprobs once it finished."""
    out: dict[str, Any] = {}
    step = 0
    while step == 0 or engine.has_unfinished() or any(at >= step for at, *_ in plan):
        for at, rid, prompt, params in plan:
            if at == step:
                engine.add_request(GenerateRequest(rid, prompt, params))
        for o in engine.step():
            assert o.error is None, o.error
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        step += 1
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "a KV block leaked"
    return out


def mixed_plan(stop_token: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    long = [(7 * i + 3) % 4000 + 100 for i in range(150)]  # chunked beside the decodes
    return [
        (0, "loop", LOOPING, SamplingParams(**GREEDY)),
        (
            0,
            "seeded-n2",
            [5, 600, 7000, 42, 9] * 3,
            SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=30),
        ),
        (2, "long", long, SamplingParams(**GREEDY)),
        (3, "prefix-hit", LOOPING + [504, 3456], SamplingParams(**GREEDY)),  # shares blocks with "loop"
        (4, "stop", LOOPING, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token])),
        (5, "logprobs", [11, 12, 13, 11, 12, 13, 11], SamplingParams(logprobs=2, **GREEDY)),
        (6, "penalties", LOOPING, SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, **GREEDY)),
    ]


def logprobs_of(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[Any]:
    engine.add_request(GenerateRequest("lp", prompt, params))
    lps: list[Any] = []
    while engine.has_unfinished():
        for o in engine.step():
            lps += o.outputs[0].new_logprobs or []
    return lps


@pytest.mark.parametrize(
    "spec, preemption",
    [("ngram", "recompute"), ("ngram", "swap"), ("draft", "recompute")],
)
def test_greedy_and_seeded_output_equal_without_speculation(
    tiny_gguf_path: Path, spec: str, preemption: str
) -> None:
    """On the quantized model (the default path: row-independent kernels, verification rows
    in the fused decode stack): the same tokens, in a batch that mixes drafting rows, plain
    decodes, a long prompt's chunks, a prefix hit, n = 2, a stop token and penalties, in a KV
    cache small enough that sequences are preempted."""
    cfg = dict(num_kv_blocks=30, block_size=8, watermark=0.0, preemption_mode=preemption, swap_space_gb=0.01)
    plain = make(tiny_gguf_path, **cfg)
    stop = serve(plain, [(0, "probe", LOOPING, SamplingParams(**GREEDY))])["probe"][0][12]
    plan = mixed_plan(stop)
    want = serve(plain, plan)
    extra = {"draft_model": str(tiny_gguf_path)} if spec == "draft" else {}
    fast = make(tiny_gguf_path, speculative=spec, speculative_adaptive=False, **extra, **cfg)
    got = serve(fast, plan)
    assert got == want
    stats = fast.spec.stats
    assert 0 < stats.accepted < stats.drafted, "both accepted and rejected drafts were verified"
    assert fast.scheduler.num_preemptions > 0
    assert len(got["stop"][0]) < 40 and got["stop"][0][-1] == stop
    # each token's logprob is the target's (the same float) at every position
    lp = SamplingParams(logprobs=2, **GREEDY)
    assert logprobs_of(fast, LOOPING, lp) == logprobs_of(plain, LOOPING, lp)


def test_structured_output_is_cut_at_the_grammar_and_equal(tiny_gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    regex = r"(ab|cd){3,12}x"
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured={"regex": regex})
    plan = [(0, "s", LOOPING, params), (0, "g", LOOPING, SamplingParams(**GREEDY))]
    want = serve(make(tiny_gguf_path), plan)
    fast = make(tiny_gguf_path, speculative="ngram", speculative_adaptive=False)
    got = serve(fast, plan)
    assert got == want
    tok = AutoTokenizer.from_pretrained(fast.model_dir)
    assert re.fullmatch(regex, tok.decode(got["s"][0], skip_special_tokens=True))
    assert fast.spec.stats.drafted > 0


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(tiny_gguf_path: Path) -> None:
    engine = make(
        tiny_gguf_path,
        speculative="draft",
        draft_model=str(tiny_gguf_path),
        speculative_adaptive=False,
        enable_prefix_caching=False,  # both models compute each prompt whole: the same KV
    )
    prompts = [[5, 600, 7000, 42, 9, 17, 300], [11, 12], list(range(100, 140))]
    serve(engine, [(i, f"r{i}", p, SamplingParams(**GREEDY)) for i, p in enumerate(prompts)])
    s = engine.spec.stats
    assert s.drafted > 60 and s.accepted == s.drafted
    assert not engine.spec.proposer._shadows, "every shadow freed with its sequence"
    assert engine.spec.proposer.bm.num_free_blocks == engine.spec.proposer.bm.num_blocks


def test_a_draft_model_with_another_vocabulary_is_refused(
    tiny_gguf_path: Path, tiny_words_model_dir: Path
) -> None:
    with pytest.raises(ValueError, match="same tokenizer|share the target's tokenizer"):
        make(tiny_gguf_path, speculative="draft", draft_model=str(tiny_words_model_dir))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` to `probs`, the tokens expected fewer than 5 times pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_speculative_sampling_keeps_the_target_distribution(tiny_words_model_dir: Path) -> None:
    """20,000 sequences with the same context and draft d, verified at temperature 0.8 and
    top_p 0.9: the first kept token is distributed as the target's first distribution p0
    (accepting d with probability p0(d)), and the second, after d was accepted, as the
    target's next one."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_words_model_dir), dtype=torch.float32)
    context = [1, 40, 41, 42, 43, 44]
    with torch.no_grad():
        row0 = hf(torch.tensor([context])).logits[0, -1]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
    vocab = row0.shape[0]

    def target(logits: torch.Tensor) -> torch.Tensor:
        one = torch.ones(1)
        return kept_probs(
            logits[None],
            one * params.temperature,
            one.long() * params.top_k,
            one * params.top_p,
            one * params.min_p,
        )[0]

    p0 = target(row0)
    draft = int(p0.argsort(descending=True)[1])  # a likely token, not the likeliest: both branches happen
    with torch.no_grad():
        row1 = hf(torch.tensor([context + [draft]])).logits[0, -1]
    p1 = target(row1)
    sampler = Sampler(vocab, eos_token_ids=[2], seed=11)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(10):  # 10 x 2,000
        seqs = [Sequence(f"r{i}", 0, context, params, 0.0) for i in range(2000)]
        for s in seqs:
            s.draft_token_ids = [draft]
        logits = torch.stack([row0, row1]).repeat(2000, 1)
        result = sampler(logits, [v for s in seqs for v in row_views(s)])  # the token stage's rows
        rows = [
            (result.token_ids[2 * i : 2 * i + 2], result.logprobs[2 * i : 2 * i + 2])
            for i in range(len(seqs))
        ]
        kept, _, bad = zip(
            *(s.keep_samples(t, lp, [2], 1000) for s, (t, lp) in zip(seqs, rows, strict=True)), strict=True
        )
        assert not any(bad) and set(kept) <= {1, 2}
        for s in seqs:
            first[s.output_token_ids[0]] += 1
            if len(s.output_token_ids) == 2:
                second[s.output_token_ids[1]] += 1
    assert abs(first[draft] / 20000 - p0[draft]) < 0.02
    assert chi_square_p(first, p0) > 0.001
    assert second.sum() == first[draft]
    assert chi_square_p(second, p1) > 0.001


def test_the_cost_model_drafts_where_rows_are_cheap_only() -> None:
    cheap, dear = DecodeRows(), DecodeRows()
    for _ in range(3):
        for rows, ms in ((1, 6.0), (2, 6.2), (4, 6.8), (8, 8.0), (16, 12.0)):
            cheap.observe(rows, ms)  # one stream on a CPU: the step's fixed cost dominates
        for rows, ms in ((32, 33.0), (33, 34.1), (36, 37.5), (48, 50.0)):
            dear.observe(rows, ms)  # 32 streams: a row costs about what a token is worth
    assert choose([8], [(0.9, 0.9)], cheap.snapshot(), 1) == [8]
    assert 1 <= choose([8], [(0.5, 0.5)], cheap.snapshot(), 1)[0] < 8
    assert choose([8] * 32, [(0.7, 0.7)] * 32, dear.snapshot(), 32) == [0] * 32
    assert choose([8], [(0.0, 0.9)], cheap.snapshot(), 1) == [0]
    assert choose([8], [(0.9, 0.9)], DecodeRows().snapshot(), 1) == [0], (
        "nothing measured yet: a plain step first"
    )
    cheap.observe(9, 500.0)  # one slow step (a collection, a neighbour): drafting goes on
    assert choose([8], [(0.9, 0.9)], cheap.snapshot(), 1)[0] >= 6


def test_without_a_backlog_a_batch_drafts_only_when_its_slowest_gains() -> None:
    """Nothing waits for room: the batch ends with its slowest sequence, so while one of them
    has nothing to draft the others' drafts only make each step dearer."""
    cost = DecodeRows()
    for _ in range(3):
        for rows, ms in ((4, 10.0), (8, 11.0), (16, 13.0), (32, 17.0)):
            cost.observe(rows, ms)  # rows still cheap: drafting pays for whoever gains
    sure = (0.95, 0.95)
    assert sum(choose([8, 8, 8, 8], [sure] * 4, cost.snapshot(), 4, backlog=True)) > 0
    assert sum(choose([8, 8, 8, 8], [sure] * 4, cost.snapshot(), 4, backlog=False)) > 0
    assert choose([8, 8, 8, 0], [sure] * 4, cost.snapshot(), 4, backlog=False) == [0] * 4
    assert (
        choose([8, 8, 8], [sure] * 3, cost.snapshot(), 4, backlog=False) == [0] * 3
    )  # a fourth decodes, undrafted
    assert sum(choose([8, 8, 8, 0], [sure] * 4, cost.snapshot(), 4, backlog=True)) > 0
