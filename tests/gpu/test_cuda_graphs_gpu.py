"""On CUDA: decode steps replayed from CUDA graphs (wsllm/engine/cuda_graphs.py) give the
eager step's greedy tokens in fp32, in every batch bucket, with mixed contexts and padded
rows; a padded bucket writes no KV. A random-weight model made here: no download, no GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_SEQS = 40  # buckets 1, 2, 4, 8, 16, 24, 32, 40
BATCHES = (1, 2, 3, 4, 5, 8, 13, 16, 20, 24, 29, 32, 40)  # each bucket, full and padded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # peaked logits: fp32 rounding between kernels cannot flip a greedy pick
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("graphs-model")
    model.save_pretrained(str(path))
    return path


def make_engine(path: Path, **kw: object):  # type: ignore[no-untyped-def]
    from wsllm.config import EngineConfig
    from wsllm.engine.engine import LLMEngine

    # every prompt of a batch in its first step (40 x 700 tokens at most), so each batch then
    # decodes at exactly its size until all its requests end together
    base: dict[str, object] = dict(
        model=str(path), device="cuda", dtype="float32", num_kv_blocks=2048, max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=32768, prefill_tokens_while_decoding=32768, prefill_ms_while_decoding=0.0,
    )  # fmt: skip
    return LLMEngine.from_config(EngineConfig(**(base | kw)))  # type: ignore[arg-type]


def greedy(engine, n: int, seed: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    from wsllm.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        length = int(torch.randint(1, 700, (1,), generator=g))  # contexts from 1 to ~710 tokens
        prompt = torch.randint(3, 2048, (length,), generator=g).tolist()
        engine.add_request(
            GenerateRequest(
                f"{seed}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            )
        )
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_graph_replay_equals_eager_in_every_bucket(model_dir: Path) -> None:
    eager = make_engine(model_dir, enforce_eager=True)
    graphs = make_engine(model_dir)
    static = graphs.runner.static
    assert eager.runner.static is None and static is not None and static.graphs is not None
    assert sorted(static.graphs.graphs) == [1, 2, 4, 8, 16, 24, 32, 40]
    replayed: list[int] = []
    replay = static.graphs.replay
    static.graphs.replay = lambda b: replayed.append(b) or replay(b)
    for n in BATCHES:
        assert greedy(graphs, n, seed=n) == greedy(eager, n, seed=n), f"batch {n}"
    assert set(replayed) == set(static.buckets)


def test_a_padded_bucket_writes_no_kv(model_dir: Path) -> None:
    from wsllm.types import GenerateRequest, SamplingParams

    engine = make_engine(model_dir, num_kv_blocks=64, block_size=16)
    g = torch.Generator(device="cuda").manual_seed(3)
    for i, n in enumerate((5, 19, 33)):
        prompt = list(range(3 + i, 3 + i + n))
        engine.add_request(
            GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        )
    engine.step()  # the three prompts
    for k, v in engine.cache.kv_caches:  # noise in every unused slot: a stray write shows
        for cache in (k, v):
            cache[cache == 0] = torch.randn(int((cache == 0).sum()), generator=g, device="cuda")
    before = [(k.clone(), v.clone()) for k, v in engine.cache.kv_caches]
    seqs = [engine._requests[f"r{i}"].seqs[0] for i in range(3)]
    bs, tables = engine.block_manager.block_size, engine.block_manager.block_tables
    want = {(tables[s.seq_id][s.num_computed_tokens // bs], s.num_computed_tokens % bs) for s in seqs}
    replayed: list[int] = []
    graphs = engine.runner.static.graphs
    replay = graphs.replay
    graphs.replay = lambda b: replayed.append(b) or replay(b)
    engine.step()  # three decodes, replayed in the graph of four
    assert replayed == [4]
    changed: set[tuple[int, int]] = set()
    for (k0, v0), (k1, v1) in zip(before, engine.cache.kv_caches, strict=True):
        diff = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1)  # [blocks, block_size]
        changed |= {(int(b), int(o)) for b, o in diff.nonzero().tolist()}
    assert changed == want
