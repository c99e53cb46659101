"""Engine behaviour on a tiny random model: preemption, seeding, abort, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.step_cost import MIN_UNITS
from wsllm.types import GenerateRequest, PromptImage, SamplingParams


@pytest.fixture(scope="module", params=["dense", "quantized"])
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_gguf_path: Path) -> Path:
    """Each test twice: on the tiny model's float weights, and on the same model as a
    GGUF of Q4_0/Q8_0 blocks computed in those blocks."""
    return tiny_model_dir if request.param == "dense" else tiny_gguf_path


def make_engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(path), **({"dtype": "float32"} | kw)))  # type: ignore[arg-type]


def run_all(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerateRequest(f"r{i}", p, sp))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def run_with_top2(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[tuple[int, dict[int, float]]]]:
    """Greedy runs with each step's two best tokens and their logprobs."""
    assert params.logprobs == 2
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", p, params))
    out: dict[str, list[tuple[int, dict[int, float]]]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            for tok, (_, top) in zip(c.new_token_ids, c.new_logprobs or [], strict=True):
                out[o.request_id].append((tok, {t: lp for t, lp in top}))
    return out


def assert_same_but_for_ties(
    got: dict[str, list[tuple[int, dict[int, float]]]],
    expected: dict[str, list[tuple[int, dict[int, float]]]],
    tol: float = 1e-3,
) -> None:
    """Equal greedy outputs, except that where the reference's two best tokens were within
    `tol` of each other, fp32 rounding (another batch, a recompute) may pick the other
    one; from there on the two continuations legitimately differ."""
    assert got.keys() == expected.keys()
    for rid, exp in expected.items():
        assert len(got[rid]) == len(exp), rid
        for i, ((tok, _), (want, top)) in enumerate(zip(got[rid], exp, strict=True)):
            if tok != want:
                assert tok in top and abs(top[want] - top[tok]) < tol, (
                    f"{rid} differs at token {i}: {tok} for {want} (top 2 of the reference: {top})"
                )
                break


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return make_engine(tiny_model_dir, kv_cache_gb=0.05)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_outputs_and_frees_every_block(tiny_model_dir: Path, mode: str) -> None:
    prompts = prompts_of([20, 35, 50, 12, 64, 28, 40, 9])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    big = make_engine(tiny_model_dir, kv_cache_gb=0.05, enable_prefix_caching=False)
    expected = run_with_top2(big, prompts, params)
    assert big.stats().num_preemptions == 0
    # 24 blocks of 8 tokens: far fewer than the ~60 the batch needs at once.
    small = make_engine(
        tiny_model_dir,
        num_kv_blocks=24,
        block_size=8,
        watermark=0.0,
        enable_prefix_caching=False,
        preemption_mode=mode,
    )
    got = run_with_top2(small, prompts, params)
    assert_same_but_for_ties(got, expected)
    stats = small.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swaps > 0
        swap = small.scheduler.swapper
        assert swap is not None and swap.num_free_blocks == swap.num_blocks, "CPU swap blocks leaked"
    assert stats.num_free_blocks == stats.num_total_blocks
    small.block_manager.check_invariants()


def test_seeded_request_is_the_same_alone_and_in_a_batch(engine: LLMEngine) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=24, ignore_eos=True)
    prompt = prompts_of([15], seed=7)[0]
    alone = run_all(engine, [prompt], [seeded])["r0"]
    others = prompts_of([5 + 3 * i for i in range(16)], seed=8)
    mixed = [SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True) for i in range(16)]
    batch = run_all(engine, others + [prompt], mixed + [seeded])
    assert batch["r16"] == alone
    # and the seed matters: another seed gives other tokens
    other = run_all(
        engine, [prompt], [SamplingParams(temperature=0.9, seed=43, max_tokens=24, ignore_eos=True)]
    )
    assert other["r0"] != alone


def test_abort_frees_blocks_before_next_step_returns(engine: LLMEngine) -> None:
    bm = engine.block_manager
    free0 = bm.num_free_blocks
    engine.add_request(
        GenerateRequest("a", prompts_of([40])[0], SamplingParams(max_tokens=100, ignore_eos=True))
    )
    engine.add_request(
        GenerateRequest("b", prompts_of([30])[0], SamplingParams(max_tokens=5, ignore_eos=True))
    )
    engine.step()
    engine.step()
    assert "a" in {s.request_id for s in engine.scheduler.running}
    assert engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert all(s.request_id != "a" for s in engine.scheduler.running)
    assert "a" not in {s.request_id for s in engine.scheduler.waiting}
    while engine.has_unfinished():
        engine.step()
    assert bm.num_free_blocks == free0
    bm.check_invariants()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
    ],
)
def test_sampling_params_reject_nonsense(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rid,prompt,params,match",
    [
        ("x", [], SamplingParams(), "token ids"),  # the wire type refuses it: GenerateRequest
        ("x", [1, 2, 49152], SamplingParams(), "token ids"),
        ("x", [1, -1], SamplingParams(), "token ids"),
        ("x", [1] * 10, SamplingParams(max_tokens=5000), "context"),
        ("dup", [1, 2], SamplingParams(), "already in use"),
        ("img", [1, 2, 3], SamplingParams(), "cannot see images"),  # a text model
    ],
)
def test_bad_requests_leave_engine_unchanged(
    engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, match: str
) -> None:
    if rid == "dup":
        engine.add_request(GenerateRequest("dup", [5, 6, 7], SamplingParams(max_tokens=2)))
    before = (engine.stats(), len(engine._requests), engine.block_manager.num_free_blocks)
    images = [PromptImage.of(b"GIF89a", "0f" * 32, 1, 2)] if rid == "img" else []
    with pytest.raises(ValueError, match=match):
        engine.add_request(GenerateRequest(rid, prompt, params, images=images))
    assert (engine.stats(), len(engine._requests), engine.block_manager.num_free_blocks) == before
    while engine.has_unfinished():
        engine.step()


def test_auto_dtype_follows_the_cpu_flags() -> None:
    from wsllm.models.build import pick_dtype

    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu, {"avx2", "fma"})[0] == torch.float32  # AVX2 only: bf16 is emulated
    assert pick_dtype("auto", cpu, {"avx512f", "avx512_bf16"})[0] == torch.bfloat16
    assert pick_dtype("auto", cpu, {"amx_bf16", "amx_tile"})[0] == torch.bfloat16
    assert pick_dtype("float32", cpu, {"avx512_bf16"})[0] == torch.float32  # asked for wins
    assert pick_dtype("auto", torch.device("cuda"), set())[0] == torch.bfloat16
    why = pick_dtype("auto", cpu, {"avx2"})[1]
    assert "avx512_bf16" in why and "amx_bf16" in why, "the log line says why"


def test_a_request_whose_sampling_fails_ends_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while sampling one row fails that request only: the others keep
    their tokens (the same as alone) and no block is left behind."""
    from wsllm.engine import sampler as sampler_mod

    prompts = prompts_of([12, 20, 7], seed=3)
    good = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run_all(engine, prompts[:2], [good, good])
    real = sampler_mod.sample_rows

    def failing(
        logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, *rest: torch.Tensor
    ) -> torch.Tensor:
        if bool((top_k == 7).any()):
            raise RuntimeError("injected fault in one row")
        return real(logits, temp, top_k, *rest)

    monkeypatch.setattr(sampler_mod, "sample_rows", failing)
    bad = SamplingParams(temperature=0.8, top_k=7, max_tokens=12, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(prompts, [good, good, bad], strict=True)):
        engine.add_request(GenerateRequest(f"r{i}", p, sp))
    outs: dict[str, object] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    failed = outs["r2"]
    assert failed.error_code == "internal_error" and "sampling failed" in (failed.error or "")  # type: ignore[attr-defined]
    assert failed.outputs[0].finish_reason == "error"  # type: ignore[attr-defined]
    for rid in ("r0", "r1"):
        assert outs[rid].outputs[0].token_ids == alone[rid]  # type: ignore[attr-defined]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


def test_the_engines_process_hands_the_gil_over_within_its_setting() -> None:
    """The step thread gives the GIL up at every operator; Python's 5 ms switch interval
    lets a gateway thread running Python keep it that long each time
    (docs/benchmarks.md, "Amplification"): `gil_switch_ms` sets the interval, 0 keeps Python's."""
    import sys

    from wsllm.models.build import apply_gil_switch

    before = sys.getswitchinterval()
    try:
        apply_gil_switch(EngineConfig(gil_switch_ms=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        apply_gil_switch(EngineConfig())
        assert sys.getswitchinterval() == pytest.approx(0.0005), "0: left as it is"
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValueError, match="gil_switch_ms"):
        EngineConfig(gil_switch_ms=-1)


def _chunks_beside_a_stream(path: Path, **kw: object) -> tuple[list[int], list[int], list[float]]:
    """A stream decodes, then a 200-token prompt arrives: (the prompt's chunk each step it
    ran, the stream's new tokens in those steps, and the prompt tokens the step-cost model's
    measured times allowed for each of them: max(floor, a decode-only step's ms / a unit's ms,
    in tokens at the prompt's context))."""
    engine = make_engine(path, kv_cache_gb=0.05, max_num_batched_tokens=512, **kw)
    scheduled: list[dict[str, int]] = []
    allowed: list[float] = []
    schedule, cost = engine.scheduler.schedule, engine.cost

    def watched() -> object:
        long = [q for q in [*engine.scheduler.running, *engine.scheduler.waiting] if q.request_id == "long"]
        ctx = long[0].num_computed_tokens if long else 0
        if cost.ms_per_unit and cost.target_ms > 0:  # the bound, from the times it measured
            units = max(MIN_UNITS, max(cost.target_ms, cost.decode_ms or 0.0) / cost.ms_per_unit)
            allowed.append(max(MIN_UNITS, cost.tokens_within(units, ctx)))
        elif cost.target_ms > 0 and cost.decode_ms is not None:  # no unit measured beside decodes yet
            allowed.append(MIN_UNITS)
        else:
            allowed.append(math.inf)
        out = schedule()
        scheduled.append({s.request_id: n for s, n in out.scheduled})
        return out

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    p = SamplingParams(max_tokens=80, ignore_eos=True)
    engine.add_request(GenerateRequest("stream", prompts_of([32])[0], p))
    for _ in range(3):  # its prompt, then two decodes (the decodes' measured time)
        engine.step()
    engine.add_request(
        GenerateRequest("long", prompts_of([200], seed=3)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    )
    scheduled.clear()
    allowed.clear()
    while any(o.request_id != "long" or not o.finished for o in engine.step()):
        pass
    steps = [(s, a) for s, a in zip(scheduled, allowed, strict=True) if "long" in s]
    return [s["long"] for s, _ in steps], [s.get("stream", 0) for s, _ in steps], [a for _, a in steps]


def test_a_prompt_beside_a_stream_is_paced_by_the_steps_measured_times(tiny_gguf_path: Path) -> None:
    # (the quantized tiny model only: the pacing is the scheduler's, whatever the weights)
    # a target no prompt token meets: the prompt work beside the stream is what fits in a
    # decode-only step's measured time (the pacer's other bound), never under the floor, so the
    # prompt comes in several chunks, the stream decoding in each (the floor alone: test_scheduler)
    chunks, stream, allowed = _chunks_beside_a_stream(tiny_gguf_path, prefill_ms_while_decoding=1e-6)
    assert len(chunks) > 1 and min(chunks[:-1]) >= MIN_UNITS and sum(chunks) == 200, chunks
    assert stream == [1] * len(chunks)
    # each chunk is the measured bound (or the rest of the prompt): a pacer that kept to its
    # floor, or ignored its measurements, cuts other chunks
    left = 200
    for chunk, units in zip(chunks, allowed, strict=True):
        assert chunk == min(left, 256, int(units)), (chunks, allowed)
        left -= chunk
    assert max(allowed) > MIN_UNITS + 1, f"the measured bound never passed the floor: {allowed}"
    # the time bound off: the token cap (256) alone, the prompt computed in one step
    chunks, stream, _ = _chunks_beside_a_stream(tiny_gguf_path, prefill_ms_while_decoding=0)
    assert chunks == [200] and stream == [1]
