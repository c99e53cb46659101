"""No host stall inside a step: between the forward pass and the step's one copy back, nothing
reads a device value (engine/model_runner.py, engine/sampler.py).

On a GPU such a read (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a `bool()` of a tensor, an
op whose output's shape depends on values) makes the host wait for every kernel queued before
it. Here the step's device part (the forward's hidden states to every tensor the step copies
back) runs over one batch that uses everything the token stage does: greedy, sampled, seeded,
penalties, logit_bias, min_tokens, logprobs, a grammar, drafts to verify, n > 1 choices forking,
a beam search, prompt logprobs and an embedding. It runs twice with the device implementation:

- on PyTorch's `meta` device (tensors with shapes and no values), where any of those reads
  raises: the part completes and hands back only meta tensors;
- on the CPU under a dispatch mode that records every op that needs a value on the host
  (`_local_scalar_dense`, which `.item()` and `bool()` reach, and the ops of data-dependent
  shape, indexing by a boolean mask among them): it records none, and its tokens are those of
  the CPU's native implementation for every row whose draw is determined (greedy, seeded,
  beams; logprobs equal). (`.tolist()`, `.cpu()` and `.numpy()` of a CPU tensor are no ops
  there: the meta run is the one that catches them.)

Checked by hand: an `.item()` or a `bool()` of a tensor put into `Sampler.draw` fails the
dispatch mode's assertion; a `.tolist()` in `logits_processors.apply_penalties` fails the meta
run; a `.cpu()` of the hidden states in `ModelRunner.after_forward` raises there. The last
test below checks that both watches see each kind of read.

The step is then finished through the packed copy (`to_host`, as on CUDA) and the engine serves
every request to its end with no block left behind.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wsllm.config import EngineConfig
from wsllm.engine.engine import LLMEngine
from wsllm.engine.model_output import ModelOutput
from wsllm.engine.model_runner import DeviceStep, ModelRunner, to_host
from wsllm.engine.sampler import Sampler
from wsllm.types import GenerateRequest, SamplingParams

aten = torch.ops.aten
# ops that give the host a device value, or whose output's shape depends on one (a sync on CUDA)
HOST_READS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique2,
    aten.unique_dim,
    aten.equal,
    aten.is_nonzero,
    aten.allclose,
}


# indexing by a boolean mask (x[mask], x[mask] = v): nonzero inside the op, so also a read
MASKED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def reads_a_value(func: Any, args: Any) -> bool:
    if func.overloadpacket in HOST_READS:
        return True
    if func.overloadpacket in MASKED and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if reads_a_value(func, args):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


PROMPT = [1, 504, 3456, 77, 9012, 33, 41]
DECODING = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=12, ignore_eos=True),
    "penalised": SamplingParams(
        temperature=0.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        logit_bias={5: 2.0, 9: -100.0},
        max_tokens=12,
        ignore_eos=True,
    ),  # fmt: skip
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=10, stop_token_ids=[7], max_tokens=12),
    "structured": SamplingParams(temperature=0.0, max_tokens=30, structured={"regex": "[0-9]{30}"}),
    "drafting": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=1),
}
ARRIVING = {
    "forks": SamplingParams(temperature=0.9, n=3, seed=11, max_tokens=6, ignore_eos=True, logprobs=1),
    "beams": SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=6),
    "prompt_lp": SamplingParams(temperature=0.0, prompt_logprobs=3, max_tokens=4, ignore_eos=True),
    "embed": SamplingParams(pooling="mean"),
}
DETERMINED = {"greedy", "seeded", "penalised", "min_tokens", "structured", "drafting", "forks", "prompt_lp"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", cpu_gemm="torch", kv_cache_gb=0.05)
    engine = LLMEngine.from_config(cfg)
    engine.matchers.warm()
    return engine


def _batch(engine: LLMEngine) -> tuple[Any, list[Any], list[Any]]:
    """Requests decoding, others arriving, one with drafts: the scheduled step and its forward."""
    engine.add_request(GenerateRequest("structured", PROMPT, DECODING["structured"]))
    for _ in range(1000):  # its grammar compiles off the step thread
        if engine.scheduler.running:
            break
        assert not [o for o in engine.step() if o.error], "the grammar compiles"
    for rid, p in DECODING.items():
        if rid != "structured":
            engine.add_request(GenerateRequest(rid, PROMPT, p))
    engine.step()
    assert {s.request_id for s in engine.scheduler.running if s.output_token_ids} == set(DECODING)
    for rid, p in ARRIVING.items():
        engine.add_request(GenerateRequest(rid, PROMPT[:5] if rid == "embed" else PROMPT, p))
    (drafting,) = [s for s in engine.scheduler.running if s.request_id == "drafting"]
    drafting.draft_token_ids[:] = [drafting.output_token_ids[-1], 17, 23]  # three drafts to verify
    sched = engine.scheduler.schedule()
    assert {s.request_id for s, _ in sched.scheduled} == set(DECODING) | set(ARRIVING), "one batch"
    engine.cache.apply(sched.swap_out, sched.swap_in, sched.copies)
    want, pool = engine._want(sched.scheduled)
    assert want and pool
    hidden, sampling, at = engine.runner.model_pass(sched.scheduled, engine.block_manager.block_tables, pool)
    return sched, [hidden, sched.scheduled, sampling, at, want, pool], sampling


def _tokens(out: ModelOutput) -> dict[tuple[str, int], tuple[list[int], Any]]:
    return {(s.seq.request_id, s.seq.index): (s.token_ids, s.logprobs) for s in out.sampled}


def test_the_steps_device_part_reads_nothing_back(engine: LLMEngine) -> None:
    sched, args, sampling = _batch(engine)
    runner = engine.runner
    assert any(q.forks for q in sampling), "choices fork in this step"
    state = runner.sampler.generator.get_state()

    # the CPU, every op watched: nothing needs a value on the host
    runner.sampler.native = False
    try:
        with HostReads() as reads:
            step = runner.after_forward(*args)
    finally:
        runner.sampler.native = True
    assert reads.seen == [], f"host reads inside the step's device part: {reads.seen}"
    assert isinstance(step, DeviceStep) and step.plan is not None and step.num_drawn >= 4

    # the meta device: any read of a value raises
    meta = torch.device("meta")
    model = copy.deepcopy(runner.model).to(meta)
    kv = [(k.to(meta), v.to(meta)) for k, v in runner.kv_caches[:1]]
    meta_runner = ModelRunner(
        model, kv, runner.block_size, meta, None, Sampler(engine.vocab_size, engine.eos_token_ids, 0, meta)
    )
    on_meta = meta_runner.after_forward(args[0].to(meta), *args[1:])
    assert on_meta.plan is not None, "the token stage failed on meta: it read a value (see the log)"
    assert on_meta.num_drawn >= 4  # ids, chosen logprobs, the best ones' values and ids
    assert on_meta.parts and all(t.is_meta for t in on_meta.parts)

    assert len(on_meta.parts) == len(step.parts)
    device = runner.finish(step, to_host(step.parts, torch.device("cpu"), pack=True))  # CUDA's one copy

    # the same rows on the CPU's native implementation
    runner.sampler.generator.set_state(state)
    native = runner.finish(
        native_step := runner.after_forward(*args), to_host(native_step.parts, torch.device("cpu"))
    )
    got, want = _tokens(device), _tokens(native)
    assert got.keys() == want.keys() and len(got) == len(sampling) + 2  # the forks' two choices
    for key in got:
        if key[0] in DETERMINED:
            assert got[key][0] == want[key][0], key
        for a, b in zip(got[key][1], want[key][1], strict=True):
            assert (a is None) == (b is None), key
            if a is not None:
                assert a[0] == pytest.approx(b[0], abs=1e-5) and [t for t, _ in a[1]] == [
                    t for t, _ in b[1]
                ], key
    beams = [[s.candidates for s in out.sampled if s.seq.request_id == "beams"] for out in (device, native)]
    assert beams[0] and beams[0][0] and beams[0] == beams[1]
    assert [(c.seq.request_id, c.first, c.entries) for c in device.prompt_logprobs] == [
        (c.seq.request_id, c.first, c.entries) for c in native.prompt_logprobs
    ]
    assert torch.equal(device.pooled[0].vector, native.pooled[0].vector)

    # the step taken from the device path's output, as LLMEngine.step takes it; every request
    # then ends, nothing leaks
    engine._keep(device)
    update = engine.scheduler.update_from_output(sched, device)
    engine.spec.record(update, [])
    done = {o.request_id: o for o in engine._report(sched.scheduled, device, update) if o.finished}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    s = engine.scheduler
    stuck = [(q.request_id, q.num_computed_tokens, q.num_tokens, q.status) for q in [*s.running, *s.waiting]]
    assert not engine.has_unfinished(), (
        stuck,
        engine.compiling and len(engine.compiling),
        list(engine._requests),
    )
    assert set(done) == set(DECODING) | set(ARRIVING) and not [o for o in done.values() if o.error]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_two_watches_see_each_kind_of_host_read() -> None:
    """What the test above relies on: the dispatch mode records `.item()`, a tensor's `bool()`
    and an op of data-dependent shape; the meta device raises on each read of a value."""
    t = torch.arange(6.0)
    with HostReads() as reads:
        t.sum().item()
        bool((t > 2).any())
        t[t > 2]  # a boolean mask: its shape needs the values
        t[t > 2] = 0.0
        torch.nonzero(t)
        t[torch.tensor([0, 2])] = t.argmax(dim=-1).float()  # device ops, indices by position: no read
    assert [s.split(".")[1] for s in reads.seen] == [
        "_local_scalar_dense",
        "_local_scalar_dense",
        "index",
        "index_put_",
        "nonzero",
    ]
    m = torch.ones(3, device="meta")
    for read in (lambda: m.sum().item(), lambda: m.tolist(), lambda: m.cpu(), lambda: m.numpy()):
        with pytest.raises((RuntimeError, NotImplementedError, TypeError)):
            read()
