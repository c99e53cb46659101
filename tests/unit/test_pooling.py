"""Embedding requests in the engine (`SamplingParams.pooling`): prefill only, the pooled
last hidden state equal to Hugging Face's `last_hidden_state` (after the final norm),
whole or in chunks, alone or batched with running generations, and their blocks freed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.outputs import RequestOutput
from wsllm.types import FINISH_STOP, GenerateRequest, SamplingParams, TokenEvent
from wsllm.wire import decode_events, decode_request, encode

LENGTHS = [1, 7, 40, 75]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def prompts_of(lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def make_engine(path: Path, **kw: Any) -> LLMEngine:
    # float32 KV: HF's states attend to unrounded keys and values (auto picks float16 on F16C)
    cfg = {"dtype": "float32", "kv_cache_dtype": "float32"} | kw
    return LLMEngine.from_config(EngineConfig(model=str(path), **cfg))


def embed_all(engine: LLMEngine, prompts: list[list[int]], pooling: str = "auto") -> dict[str, RequestOutput]:
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"e{i}", p, SamplingParams(max_tokens=1, pooling=pooling)))
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in outs, "an embedding request reports once"
            outs[o.request_id] = o
    return outs


def hf_states(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]


def assert_close(got: list[float] | None, want: torch.Tensor) -> None:
    assert got is not None
    torch.testing.assert_close(torch.tensor(got), want.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole", "chunked"])
def test_last_and_mean_equal_hf(tiny_model_dir: Path, hf: Any, budget: int) -> None:
    prompts = prompts_of(LENGTHS)
    for pooling in ("last", "mean"):
        engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget, num_kv_blocks=64)
        outs = embed_all(engine, prompts, pooling)
        for i, ids in enumerate(prompts):
            o = outs[f"e{i}"]
            states = hf_states(hf, ids)
            assert_close(o.embedding, states[-1] if pooling == "last" else states.mean(dim=0))
            assert o.finished and o.outputs[0].finish_reason == FINISH_STOP
            assert o.outputs[0].token_ids == [] and o.num_prompt_tokens == len(ids)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.block_manager.check_invariants()


def test_auto_is_last_for_decoder_models(tiny_model_dir: Path, hf: Any) -> None:
    engine = make_engine(tiny_model_dir)
    assert engine.pooling == "last"
    (ids,) = prompts_of([12])
    assert_close(embed_all(engine, [ids])["e0"].embedding, hf_states(hf, ids)[-1])


def test_mean_takes_no_prefix_hit(tiny_model_dir: Path, hf: Any) -> None:
    """A prompt whose blocks are cached still sums every position (a hit would leave
    positions out of the mean); last pooling may take the hit and gives the same vector."""
    engine = make_engine(tiny_model_dir, block_size=8, pooling="mean")
    (ids,) = prompts_of([40])
    first = embed_all(engine, [ids])["e0"]
    again = embed_all(engine, [ids])["e0"]
    assert again.num_cached_tokens == 0
    assert first.embedding == again.embedding
    assert_close(again.embedding, hf_states(hf, ids).mean(dim=0))
    last = embed_all(engine, [ids], "last")["e0"]
    assert last.num_cached_tokens > 0
    assert_close(last.embedding, hf_states(hf, ids)[-1])


def test_batched_with_generations_changes_nothing(tiny_model_dir: Path) -> None:
    """Embeddings computed beside running generations (decodes and chunked prefills in
    the same steps) equal those computed alone; the generations are untouched too."""
    prompts = prompts_of([3, 30, 64, 100], seed=9)
    alone_engine = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    alone = embed_all(alone_engine, prompts, "mean")
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    gen_prompts = prompts_of([20, 50], seed=11)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    for i, p in enumerate(gen_prompts):
        engine.add_request(GenerateRequest(f"g{i}", p, greedy))
    for _ in range(3):  # the generations are decoding when the embeddings arrive
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"e{i}", p, SamplingParams(pooling="mean")))
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    for i in range(len(prompts)):
        a, b = alone[f"e{i}"].embedding, outs[f"e{i}"].embedding
        assert a is not None and b is not None
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    solo = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    for i, p in enumerate(gen_prompts):
        solo.add_request(GenerateRequest(f"g{i}", p, greedy))
    want: dict[str, list[int]] = {}
    while solo.has_unfinished():
        want.update((o.request_id, o.outputs[0].token_ids) for o in solo.step() if o.finished)
    assert {f"g{i}": outs[f"g{i}"].outputs[0].token_ids for i in range(2)} == want
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_limits_and_abort(tiny_model_dir: Path) -> None:
    """An embedding may fill the whole context (no token is generated); past it is a
    ValueError; an aborted one frees its blocks and reports no vector."""
    engine = make_engine(tiny_model_dir, max_model_len=64)
    engine.add_request(GenerateRequest("full", list(range(3, 67)), SamplingParams(pooling="last")))
    with pytest.raises(ValueError, match="context of 64"):
        engine.add_request(GenerateRequest("over", list(range(3, 68)), SamplingParams(pooling="last")))
    assert engine.abort("full")
    (out,) = engine.step()
    assert out.embedding is None and out.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_pooling_params_are_checked() -> None:
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="last", n=2)


def test_wire_carries_pooling_and_embedding_only_when_set() -> None:
    """Both fields cross the wire, and are left out while unset (older peers read the rest)."""
    req = GenerateRequest("r", [5, 6], SamplingParams(max_tokens=1, pooling="auto"))
    assert decode_request(encode(req)).params.pooling == "auto"
    plain = orjson.loads(encode(GenerateRequest("r", [5], SamplingParams())))
    assert "pooling" not in plain["item"]["params"]
    ev = TokenEvent("r", 0, [], finish_reason=FINISH_STOP, embedding=[0.5, -1.25])
    assert decode_events(encode([ev]))[0].embedding == [0.5, -1.25]
    assert "embedding" not in orjson.loads(encode([TokenEvent("r", 0, [7])]))["items"][0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_embeddings_still_equal_hf(tiny_model_dir: Path, hf: Any, mode: str) -> None:
    """Generations growing into a small cache preempt the embeddings mid-prompt; a
    recompute starts the mean over, a swap keeps it, and both equal HF."""
    engine = make_engine(
        tiny_model_dir, num_kv_blocks=10, max_num_batched_tokens=8, preemption_mode=mode, watermark=0.0
    )
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts_of([40, 40], seed=13)):
        engine.add_request(GenerateRequest(f"g{i}", p, greedy))
    for _ in range(12):  # both prompts computed: the generations decode
        engine.step()
    prompts = prompts_of([60, 45], seed=17)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"e{i}", p, SamplingParams(pooling="mean")))
    outs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.scheduler.num_swaps > 0) == (mode == "swap")
    for i, ids in enumerate(prompts):
        assert_close(outs[f"e{i}"].embedding, hf_states(hf, ids).mean(dim=0))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_offline_llm_returns_embeddings(tiny_model_dir: Path, hf: Any) -> None:
    from wsllm.llm import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="float32")
    (r,) = llm.generate("The cat sat on the mat.", SamplingParams(pooling="mean"))
    assert r.token_ids == [] and r.finish_reason == FINISH_STOP
    assert_close(r.embedding, hf_states(hf, r.prompt_token_ids).mean(dim=0))
