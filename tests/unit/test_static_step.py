"""The static decode step (wsllm/engine/static_step.py) on the CPU: the bucket-padded step
that CUDA captures as graphs runs here as a plain call, and gives the packed eager step's
greedy tokens, through preemption, prefix hits and n > 1; padded rows write no KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.static_step import batch_buckets, static_mode
from wsllm.types import GenerateRequest, SamplingParams


def make_engine(path: Path, static: str, **kw: object) -> LLMEngine:
    # the pacer off: both engines must schedule the same batches, whatever each step took
    base: dict[str, object] = dict(
        model=str(path), dtype="float32", static_decode=static, prefill_ms_while_decoding=0.0
    )
    return LLMEngine.from_config(EngineConfig(**(base | kw)))  # type: ignore[arg-type]


def test_buckets_cover_every_batch_up_to_max_num_seqs() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_the_static_step_is_the_default_on_cuda_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_mode(EngineConfig(), cpu) is None  # the CPU keeps its fused eager step
    assert static_mode(EngineConfig(), cuda) == "graphs"
    assert static_mode(EngineConfig(enforce_eager=True), cuda) is None
    assert static_mode(EngineConfig(static_decode="on"), cpu) == "plain"
    assert static_mode(EngineConfig(static_decode="on", enforce_eager=True), cuda) == "plain"
    assert static_mode(EngineConfig(static_decode="off"), cuda) is None
    with pytest.raises(ValueError, match="static_decode"):
        EngineConfig(static_decode="sometimes")


def run(engine: LLMEngine, steps_before: dict[int, int]) -> tuple[dict[str, list[list[int]]], list[int]]:
    """The workload: requests join at the step `steps_before` names (so later ones find the
    earlier ones' prefix cached); returns every choice's tokens, and the row count of each
    static step that ran."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 49152, (24,), generator=g).tolist()  # three blocks of 8
    prompts = [shared + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1, 12)]
    prompts[2] = torch.randint(3, 49152, (41,), generator=g).tolist()  # one without the prefix
    rows: list[int] = []
    if engine.runner.static is not None:
        static_run = engine.runner.static.run

        def recording(scheduled, tables):  # type: ignore[no-untyped-def]
            rows.append(len(scheduled))
            return static_run(scheduled, tables)

        engine.runner.static.run = recording  # type: ignore[method-assign]
    out: dict[str, list[list[int]]] = {}
    step = 0
    while step <= max(steps_before.values()) or engine.has_unfinished():
        for i, at in steps_before.items():
            if at == step:
                n = 2 if i == 3 else 1  # one request of two greedy choices: they fork and share blocks
                params = SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True, n=n)
                engine.add_request(GenerateRequest(f"r{i}", prompts[i], params))
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        step += 1
    return out, rows


def test_padded_static_steps_give_the_eager_tokens(tiny_model_dir: Path) -> None:
    joins = {0: 0, 1: 0, 2: 1, 3: 4, 4: 6, 5: 7}
    # 20 blocks of 8 tokens: fewer than the batch needs at its widest, so some are preempted
    kw = dict(num_kv_blocks=20, block_size=8, watermark=0.0, max_num_seqs=8)
    eager = make_engine(tiny_model_dir, "off", **kw)
    static = make_engine(tiny_model_dir, "on", **kw)
    expected, _ = run(eager, joins)
    got, rows = run(static, joins)
    assert got == expected
    for e in (eager, static):  # what the workload was built to exercise, in both runs
        s = e.stats()
        assert s.num_preemptions > 0 and s.prefix_hit_tokens > 0
        assert s.num_free_blocks == s.num_total_blocks
    buckets = static.runner.static.buckets  # type: ignore[union-attr]
    assert any(n not in buckets for n in rows), f"no step was padded: {rows}"
    assert len({static.runner.static.bucket_for(n) for n in rows}) >= 3  # type: ignore[union-attr]


def test_padded_rows_change_no_kv_block(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, "on", num_kv_blocks=40, block_size=8, max_num_seqs=8)
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate((5, 19, 33)):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        engine.add_request(
            GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        )
    engine.step()  # the three prompts
    # every block's unused slots hold noise, so a stray write anywhere shows
    for k, v in engine.cache.kv_caches:
        for cache in (k, v):
            cache[cache == 0] = torch.randn(int((cache == 0).sum()), generator=g).to(cache.dtype)
    before = [(k.clone(), v.clone()) for k, v in engine.cache.kv_caches]
    seqs = [engine._requests[f"r{i}"].seqs[0] for i in range(3)]
    bs = engine.block_manager.block_size
    tables = engine.block_manager.block_tables
    want = {(tables[s.seq_id][s.num_computed_tokens // bs], s.num_computed_tokens % bs) for s in seqs}
    rows: list[int] = []
    static_run = engine.runner.static.run  # type: ignore[union-attr]
    engine.runner.static.run = lambda sch, t: rows.append(len(sch)) or static_run(sch, t)  # type: ignore[method-assign,union-attr]
    engine.step()  # three decodes in a bucket of four
    assert rows == [3] and engine.runner.static.bucket_for(3) == 4  # type: ignore[union-attr]
    changed: set[tuple[int, int]] = set()
    for (k0, v0), (k1, v1) in zip(before, engine.cache.kv_caches, strict=True):
        diff = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1)  # [blocks, block_size]
        changed |= {(int(b), int(o)) for b, o in diff.nonzero().tolist()}
    assert changed == want
