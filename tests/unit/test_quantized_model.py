"""The model over quantized blocks: a GGUF served in its Q4_1/Q8_0 (and Q4_0) blocks
computes what a torch reference of the same arithmetic computes, close to the
de-quantized model (so the loader's Q/K row permutation is right); the repacked
weights are cached once; the features that run on the tiny quantized model beyond
tests/unit/test_engine.py and test_kv_sharing.py (which run each test on it too)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from wsllm.kernels import quant

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.models import loader
from wsllm.models.quant_linear import QuantEmbedding, QuantLinear
from wsllm.types import GenerateRequest, SamplingParams

CHATS = ["What is the capital of France?", "Write a haiku about rain.", "def fib(n):"]


def make_engine(model: Path | None, **kw: object) -> LLMEngine:
    cfg = {"dtype": "float32", "kv_cache_gb": 0.05} | kw
    return LLMEngine.from_config(EngineConfig(model=None if model is None else str(model), **cfg))  # type: ignore[arg-type]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", p, params))
    out: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
    return [out[f"r{i}"] for i in range(len(prompts))]


def prompt_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The logprob of each prompt token after the first."""
    engine.add_request(GenerateRequest("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            got = o.prompt_logprobs if o.prompt_logprobs is not None else got
    assert got is not None
    return torch.tensor([p[0] for p in got[1:]])


@pytest.fixture(scope="module")
def chat_ids(smollm_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for c in CHATS
    ]


@pytest.fixture(scope="module")
def smollm_quant() -> LLMEngine:
    """The bundled GGUF with the defaults but fp32 activations: its blocks, the kernels."""
    return make_engine(None)


def test_the_bundled_gguf_is_served_in_its_blocks(smollm_quant: LLMEngine) -> None:
    model = smollm_quant.runner.model
    kinds = {m.qweight.qtype for m in model.modules() if isinstance(m, QuantLinear)}
    assert kinds == {"Q4_1", "Q8_0"}  # Q8_0: the tied lm_head, shared with the embedding
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.qweight is model.lm_head.qweight, "one copy of the tied blocks"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_greedy_equals_the_torch_reference_of_the_same_arithmetic(
    smollm_quant: LLMEngine, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # A first run fills the prefix cache, so that both compared runs hit it alike: a prompt
    # computed whole and one computed from cached blocks sum attention in another order, and
    # the int8 rounding of every activation downstream turns that last-bit difference into
    # 0.07-0.16 nats on a first token here (fp32, before and after the float16 cache), enough
    # to flip a near-tie.
    run(smollm_quant, chat_ids, greedy)
    native = run(smollm_quant, chat_ids, greedy)  # decode steps: the native decode stack
    monkeypatch.setattr(quant, "qlinear", quant.qlinear_reference)
    monkeypatch.setattr(smollm_quant.runner.model, "fused_decode", False)  # every matmul the reference's
    assert run(smollm_quant, chat_ids, greedy) == native


def run_recording_logits(engine: LLMEngine) -> tuple[list[list[list[int]]], list[torch.Tensor]]:
    """3 sequences of different lengths decoding together, greedy: their tokens, and every
    step's logits as the model computed them."""
    model = engine.runner.model
    seen: list[torch.Tensor] = []
    compute = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute(hidden))
        return seen[-1]

    model.compute_logits = record  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return run(engine, [[1, 504, 3456], [5, 600, 7000, 42, 9, 17, 300], [11, 12]], params), seen


@pytest.mark.parametrize("isa", ["avx512_vnni", "avx2", "scalar"])
def test_the_fused_decode_stack_gives_the_layer_by_layer_logits(tiny_gguf_path: Path, isa: str) -> None:
    """A decode-only step over quantized weights runs its layers in one native call
    (kernels.decode_stack); its logits are those of the layer-by-layer step, bit for bit,
    on each kernel path, for 3 sequences of different lengths decoding together."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    try:
        quant.force_isa(isa)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        got = {}
        for fused in (True, False):
            engine = make_engine(tiny_gguf_path, enable_prefix_caching=False)
            model = engine.runner.model
            model.fused_decode = fused
            got[fused] = run_recording_logits(engine)
            assert (model._stack is not None and model._stack[2] is not None) == fused
        assert got[True][0] == got[False][0]
        assert len(got[True][1]) == len(got[False][1]) > 3
        for a, b in zip(got[True][1], got[False][1], strict=True):
            assert torch.equal(a, b)
    finally:
        quant.force_isa(None)


def test_the_decode_stack_runs_the_layers_the_model_describes(tiny_qwen3_dir: Path) -> None:
    """The stack's program comes from the model's own layers (`native_ops`): a Qwen3's QK-norm
    is a step of its program, so its decode-only steps run in the one native call and give the
    layer-by-layer logits, bit for bit."""
    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    got = {}
    for fused in (True, False):
        engine = make_engine(tiny_qwen3_dir, quantization="q8_0", enable_prefix_caching=False)
        model = engine.runner.model
        model.fused_decode = fused
        got[fused] = run_recording_logits(engine)
        assert (model._stack is not None and model._stack[2] is not None) == fused
    assert got[True][0] == got[False][0]
    for a, b in zip(got[True][1], got[False][1], strict=True):
        assert torch.equal(a, b)


def test_quantized_logits_are_close_to_the_dequantized_model(
    smollm_quant: LLMEngine, smollm_dir: Path, chat_ids: list[list[int]]
) -> None:
    """The de-quantized model is transformers' reading of the same GGUF. Measured: the
    kernels' int8 activations move the prompt's logprobs by 0.058 nats on average (0.67
    at most); without the Q/K row un-permutation they move by 3.4 (16 at most)."""
    ids = sum(chat_ids, [])
    quantized = prompt_logprobs(smollm_quant, ids)
    dense = prompt_logprobs(make_engine(smollm_dir, quantization="none"), ids)
    diff = (quantized - dense).abs()
    assert diff.mean() < 0.1 and diff.max() < 1.0, (diff.mean(), diff.max())


def test_the_repacked_weights_are_cached_once_and_reused(
    tiny_gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    quant.native_status()  # the kernels' build stays in the usual cache (loaded before the move)
    monkeypatch.setenv("WSLLM_CACHE_DIR", str(tmp_path))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 600, 7000, 42], [9, 8, 7]]
    with caplog.at_level(logging.INFO, logger="wsllm.models.gguf_weights"):
        first = run(make_engine(tiny_gguf_path), prompts, greedy)
    assert any("repacking" in r.message for r in caplog.records)
    (index,) = tmp_path.glob("gguf/*-quant*/index.json")
    written = index.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wsllm.models.gguf_weights"):
        second = run(make_engine(tiny_gguf_path), prompts, greedy)
    assert not any("repacking" in r.message for r in caplog.records), "the second start repacked"
    assert index.stat().st_mtime_ns == written
    assert second == first
    assert json.loads(index.read_text())["counts"] == {"Q4_0": 10, "Q8_0": 5}


def test_without_a_compiler_the_engine_serves_dequantized_with_one_warning(
    tiny_gguf_path: Path, tmp_path: Path
) -> None:
    """No C++ compiler and no cached build (a fresh cache): the engine starts on the
    de-quantized weights, and one warning line says why."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
        "from wsllm.config import EngineConfig; from wsllm.engine.engine import LLMEngine; from wsllm.types import GenerateRequest, SamplingParams\n"
        "from wsllm.models.quant_linear import QuantLinear\n"
        f"e = LLMEngine.from_config(EngineConfig(model={str(tiny_gguf_path)!r}, dtype='float32', kv_cache_gb=0.05))\n"
        "assert not any(isinstance(m, QuantLinear) for m in e.runner.model.modules())\n"
        "e.add_request(GenerateRequest('a', [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4)))\n"
        "while e.has_unfinished(): e.step()\n"
        "print('served')\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "WSLLM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "served" in out.stdout, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING wsllm")]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0], warnings


def test_a_float_checkpoint_quantized_at_load(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    ids = torch.randint(3, 49152, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    dense = prompt_logprobs(make_engine(tiny_model_dir), ids)
    for qtype, tol in (("q8_0", 0.05), ("q4_0", 0.3)):
        with caplog.at_level(logging.INFO, logger="wsllm.models.build"):
            engine = make_engine(tiny_model_dir, quantization=qtype)
        assert any(
            "weights kept quantized" in r.message and qtype.upper() in r.message for r in caplog.records
        )
        diff = (prompt_logprobs(engine, ids) - dense).abs()
        assert diff.mean() < tol, (qtype, diff.mean())


def test_structured_output_and_beams_on_the_quantized_model(tiny_gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    engine = make_engine(tiny_gguf_path)
    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    outs = run(
        engine,
        [[1, 504, 3456]],
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured={"regex": regex}),
    )
    assert re.fullmatch(regex, tok.decode(outs[0][0], skip_special_tokens=True))
    beams = run(
        engine,
        [[1, 504, 3456, 77]],
        SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=6, ignore_eos=True),
    )
    assert len(beams[0]) == 3 and len({tuple(b) for b in beams[0]}) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_quantized_and_a_dense_model_in_one_process(tiny_gguf_path: Path, tiny_model_dir: Path) -> None:
    """Engines side by side (as `wsllm serve --model a --model b` runs them) give what
    each gives alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 600, 7000, 42], [11, 12, 13, 14, 15]]
    alone = {p: run(make_engine(p), prompts, greedy) for p in (tiny_gguf_path, tiny_model_dir)}
    engines = {p: make_engine(p) for p in (tiny_gguf_path, tiny_model_dir)}
    for e in engines.values():
        for i, ids in enumerate(prompts):
            e.add_request(GenerateRequest(f"r{i}", ids, greedy))
    got: dict[Path, dict[str, list[int]]] = {p: {} for p in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for p, e in engines.items():  # interleaved steps
            for o in e.step():
                if o.finished:
                    got[p][o.request_id] = o.outputs[0].token_ids
    for p in engines:
        assert [[got[p][f"r{i}"]] for i in range(len(prompts))] == alone[p]


def test_a_quantized_start_holds_no_dequantized_weights(tmp_path: Path) -> None:
    """Resident memory after loading the bundled GGUF in its blocks: the fp32 weights
    alone would be 540 MB (measured with them: about 1.45 GB)."""
    code = (
        "from wsllm.config import EngineConfig; from wsllm.engine.engine import LLMEngine; "
        "LLMEngine.from_config(EngineConfig(kv_cache_gb=0.05)); "
        # VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's (this pytest's)
        "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) // 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    peak_mb = int(out.stdout.strip().splitlines()[-1])
    assert peak_mb < 800, f"peak resident memory {peak_mb} MB"


def test_a_q4_k_m_like_gguf_reads_close_to_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K formats as a Q4_K_M file mixes them (bench/big_model.py's writer, small shapes):
    q and k in one Q4_K matmul, v in Q6_K beside it, an untied Q6_K output layer."""
    import importlib.util

    from wsllm.models.quant_linear import SplitLinear

    spec = importlib.util.spec_from_file_location(
        "big_model_for_test", Path(__file__).parents[2] / "bench" / "big_model.py"
    )
    assert spec is not None and spec.loader is not None
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    big = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(big)
    big.SHAPES.update(vocab=49408, hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, ctx=1024)
    quant.native_status()  # the kernels' build stays in the usual cache (loaded before the move)
    monkeypatch.setenv("WSLLM_CACHE_DIR", str(tmp_path))
    with loader.shared_gguf_readers():  # each file parsed once: the writer's and both starts' reads
        path = big.write_gguf(tmp_path / "small.Q4_K_M.gguf")
        engine = make_engine(path)
        dense = make_engine(path, quantization="none")
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, SplitLinear)
    assert [p.qweight.qtype for p in layer.self_attn.qkv_proj.parts] == ["Q4_K", "Q6_K"]
    assert engine.runner.model.lm_head.qweight.qtype == "Q6_K"
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    diff = (prompt_logprobs(engine, ids) - prompt_logprobs(dense, ids)).abs()
    # measured: 0.005 nats on average; 0.048 without the Q/K row un-permutation
    assert diff.mean() < 0.02, diff.mean()


def test_a_quantization_it_cannot_do_is_a_clear_error(tiny_gguf_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be auto, none, q8_0 or q4_0"):
        EngineConfig(quantization="q5_k")
    with pytest.raises(ValueError, match="a GGUF keeps its own formats"):
        make_engine(tiny_gguf_path, quantization="q8_0")


def test_the_decode_stack_on_a_team_gives_one_threads_bits_even_with_its_helpers_held(
    smollm_quant: LLMEngine, chat_ids: list[list[int]]
) -> None:
    """A decode-only step's layers run as one team of torch's threads (kernels/cpu/team.h):
    every loop in chunks that the threads claim, the calling thread taking whatever nobody
    claimed. Whoever computes a chunk, the logits are the bits of one thread and of a loop per
    operator (at::parallel_for); with the team's other threads held on purpose (threads that
    never get a core) each step still ends, on the calling thread alone."""
    from wsllm.kernels import native

    ext = native.extension()
    if ext is None:
        pytest.skip(f"no native build: {native.failure()}")
    model, before = smollm_quant.runner.model, torch.get_num_threads()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    run(smollm_quant, chat_ids, greedy)  # the prefix cache filled: each run below hits it alike
    got: dict[str, tuple[list[list[list[int]]], list[torch.Tensor]]] = {}
    compute = model.compute_logits
    try:
        for setting in ("team", "loops", "held", "one thread"):
            ext.set_teams(on=setting != "loops", hold_helpers=setting == "held")
            torch.set_num_threads(1 if setting == "one thread" else 2)
            if setting in ("team", "held"):
                assert ext.team_threads() == (1 if setting == "held" else 2), setting
            seen: list[torch.Tensor] = []
            model.compute_logits = lambda h, seen=seen: seen.append(compute(h)) or seen[-1]  # type: ignore[method-assign]
            got[setting] = (run(smollm_quant, chat_ids, greedy), seen)
    finally:
        del model.compute_logits  # the class's again
        ext.set_teams(on=True, hold_helpers=False)
        torch.set_num_threads(before)
    tokens, logits = got["one thread"]
    assert len(logits) >= 8  # the first step, then decode-only steps: the stack
    for setting, (t, lg) in got.items():
        assert t == tokens and len(lg) == len(logits), setting
        assert all(torch.equal(a, b) for a, b in zip(lg, logits, strict=True)), setting
