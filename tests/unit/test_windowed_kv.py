"""Sliding-window layers in the KV manager (engine/kv_groups.py): blocks every windowed layer has
left behind go back to the pool while the full layers keep theirs.

- Greedy tokens past the window equal HF `generate` in fp32 (a Qwen2 of windowed and full layers,
  a Mistral windowed on every layer), with chunked prefill across the window, prefix hits that
  cross it and preemption (swap, recompute); the CPU, torch-reference and Triton (interpreter)
  paths give the same tokens, with n-gram speculation too.
- A property over random schedules, without a model: a stand-in cache holds the token each slot
  was written with, and every position a layer reads in a step (its window's, or all) must hold
  that token through its group's table: no block is freed that a layer still reads (a freed
  block handed to another sequence and written would show), none leaks, and a windowed table
  holds only its window's blocks. With prefix hits, chunked prefill, drafts rejected and kept,
  n > 1 forks (copy on write) and both preemption modes.
- A Gemma-3-shaped model (Gemma-3-4B's 34 layers, five windowed of 1,024 to one full) at 16k
  tokens of context holds <= 0.3x the KV bytes of full attention, counted by the block managers
  as the real scheduler drives them over token counts.
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: @jit reads it at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from wsllm.config import EngineConfig  # noqa: E402
from wsllm.engine.cache_engine import bytes_per_block, group_block_bytes  # noqa: E402
from wsllm.engine.engine import LLMEngine  # noqa: E402
from wsllm.engine.kv_groups import HybridBlockManager, KVGroup, kv_bytes_used, kv_groups, split_blocks  # noqa: E402
from wsllm.engine.model_output import ModelOutput, Sampled  # noqa: E402
from wsllm.engine.scheduler import Scheduler  # noqa: E402
from wsllm.engine.sequence import Sequence  # noqa: E402
from wsllm.engine.swap import CpuSwapSpace  # noqa: E402
from wsllm.models.config import ModelConfig  # noqa: E402
from wsllm.types import GenerateRequest, SamplingParams  # noqa: E402

WINDOW = 20  # tiny_window_dirs'


def test_hf_configs_say_which_layers_are_windowed() -> None:
    from wsllm.models import registry

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4}
    off = registry.model_config(
        base | {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    )
    assert [off.layer(i).window for i in range(4)] == [0] * 4, "Qwen's switch off: no window"
    qwen = base | {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
    }
    assert [registry.model_config(qwen).layer(i).window for i in range(4)] == [0, 8, 8, 8]
    mistral = registry.model_config(base | {"model_type": "mistral", "sliding_window": 8})
    assert [mistral.layer(i).window for i in range(4)] == [8] * 4
    assert [g.window for g in kv_groups(mistral)] == [8]


def _engine(path: Path, **kw: Any) -> LLMEngine:
    base: dict[str, Any] = dict(
        model=str(path),
        dtype="float32",
        kv_cache_dtype="float32",
        block_size=8,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        kv_cache_gb=0.02,
    )
    return LLMEngine.from_config(EngineConfig(**(base | kw)))


def _waves(
    engine: LLMEngine, waves: list[list[list[int]]], max_tokens: int, ignore_eos: bool = True
) -> dict[str, list[int]]:
    """Greedy runs, wave after wave (the second hits the prefix cache of the first)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    out: dict[str, list[int]] = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(f"w{w}r{i}", p, params))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
    return out


def _prompts(seed: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 49152, (45,), generator=g).tolist()
    other = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 30, 12)]
    # the second wave: hits of 5 blocks (40 tokens, past the window) and of 4 first, while the
    # first wave's blocks are all cached, then two more prompts that crowd the cache
    return [[base], [base + other[2], base[:33] + other[0], other[1], other[0]]]


@pytest.mark.parametrize(("kind", "mode", "blocks"), [("qwen2", "swap", 16), ("mistral", "recompute", 10)])
def test_greedy_past_the_window_equals_hf(
    kind: str, mode: str, blocks: int, tiny_window_dirs: dict[str, Path]
) -> None:
    """The Qwen2's decode steps run the static, padded step (a slot mapping and block tables
    per KV group in its buffers, as CUDA's graphs read them); the Mistral's the CPU plan's."""
    from transformers import AutoModelForCausalLM

    path = tiny_window_dirs[kind]
    static = "on" if kind == "qwen2" else "off"
    engine = _engine(
        path, num_kv_blocks=blocks, preemption_mode=mode, swap_space_gb=0.01, static_decode=static
    )
    groups = [g.window for g in kv_groups(engine.runner.model.config)]
    assert groups == ([0, WINDOW] if kind == "qwen2" else [WINDOW])
    assert isinstance(engine.block_manager, HybridBlockManager)
    waves = _prompts(1)
    got = _waves(engine, waves, 10, ignore_eos=False)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "a cache this small preempts"
    assert stats.prefix_hit_tokens >= 40 + 32, "the second wave's hits cross the window"
    assert stats.kv_bytes_used == 0 and stats.kv_bytes_total > 0, "everything finished went back"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            with torch.no_grad():
                ids = hf.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=10,
                    do_sample=False,
                    eos_token_id=engine.eos_token_ids,
                    pad_token_id=0,
                )
            assert got[f"w{w}r{i}"] == ids[0, len(p) :].tolist(), (kind, w, i)


_PATTERN = torch.randint(3, 49152, (5,), generator=torch.Generator().manual_seed(3)).tolist()
# repeats (n-gram drafts), a second wave that hits 4 blocks (32 tokens, past the window)
WAVES = [[_PATTERN * 7, _prompts(2)[1][3]], [_PATTERN * 8 + _PATTERN[:2]]]


@functools.cache
def _reference(path: Path) -> dict[str, list[int]]:
    from wsllm import kernels

    try:
        return _waves(_engine(path, attention_backend="torch"), WAVES, 8)
    finally:
        kernels.use_backend("auto")


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_the_cpu_and_triton_paths_equal_the_torch_reference_past_the_window(
    backend: str, tiny_window_dirs: dict[str, Path]
) -> None:
    """`auto` on a CPU: the native kernels and the CPU plan; `triton` in the interpreter."""
    from wsllm import kernels

    if backend == "triton":
        pytest.importorskip("triton")
    path = tiny_window_dirs["qwen2"]
    ref = _reference(path)
    try:
        engine = _engine(path, attention_backend=backend, speculative="ngram", speculative_adaptive=False)
        assert _waves(engine, WAVES, 8) == ref
    finally:
        kernels.use_backend("auto")
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 32 and stats.spec_draft_tokens > 0, "hits past the window, drafts"


def test_the_decode_stack_reads_each_layers_kv_group(tiny_window_dirs: dict[str, Path]) -> None:
    """Over quantized weights a decode-only step runs every layer in one native call, each
    attention op over its KV group's slots and tables: the logits of the layer-by-layer step,
    bit for bit, past the window."""
    from wsllm.kernels import quant

    ok, why = quant.native_status()
    if not ok:
        pytest.skip(why)
    got: dict[bool, tuple[dict[str, list[int]], list[torch.Tensor]]] = {}
    for fused in (True, False):
        engine = _engine(tiny_window_dirs["qwen2"], quantization="q8_0", enable_prefix_caching=False)
        model = engine.runner.model
        model.fused_decode = fused
        seen: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda h, seen=seen, compute=compute: seen.append(compute(h)) or seen[-1]  # type: ignore[method-assign,misc]
        tokens = _waves(engine, [_prompts(4)[1][2:]], 14)  # 30 and 7 tokens, then 14 more each
        assert (model._stack is not None and model._stack[2] is not None) == fused
        got[fused] = (tokens, seen)
    assert got[True][0] == got[False][0]
    assert len(got[True][1]) == len(got[False][1]) > 10
    for a, b in zip(got[True][1], got[False][1], strict=True):
        assert torch.equal(a, b)


def test_the_kv_bytes_held_are_the_managers_own_count(tiny_window_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_window_dirs["qwen2"])
    engine.add_request(
        GenerateRequest("r", list(range(3, 63)), SamplingParams(max_tokens=30, ignore_eos=True))
    )
    for _ in range(10):
        engine.step()
    bm = engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    full, windowed = bm.groups
    per_layer = engine.cache.block_bytes[0]  # the full group has one layer, the windowed two
    assert engine.cache.block_bytes == [per_layer, 2 * per_layer]
    seq = engine.scheduler.running[0]
    assert seq.num_computed_tokens > WINDOW + 16, "past the window"
    # the windowed group holds its last window's blocks only; the full group every block
    assert full.num_used_blocks == full.blocks_for(seq.num_computed_tokens)
    assert windowed.num_used_blocks == full.blocks_for(seq.num_computed_tokens) - windowed.window_start(
        seq.num_computed_tokens
    )
    used = engine.stats().kv_bytes_used
    assert used == full.num_used_blocks * per_layer + windowed.num_used_blocks * 2 * per_layer
    assert used < 3 * per_layer * full.num_used_blocks, "less than full attention on every layer"


# -- the property: random schedules over a stand-in cache ----------------------------------

VOCAB = 10


def truth(context: list[int]) -> int:
    a, b, c = ([0, 0, 0] + context)[-3:]
    return (a * 7 + b * 3 + c * 5 + len(context) % 2) % VOCAB


class Stand:
    """The scheduler and block managers of a model of groups `windows` (0: full), a cache that
    holds per slot the token written there, and a 'model' that reads every position its layers
    read through each group's table, checks it, and predicts `truth` of the context."""

    def __init__(self, rng: random.Random, windows: list[int], bs: int, sizes: list[int], mode: str) -> None:
        self.rng, self.bs = rng, bs
        groups = [KVGroup(w, (i,)) for i, w in enumerate(windows)]
        self.bm = HybridBlockManager(groups, sizes, bs, 0.0, True)
        self.groups, self.offsets = self.bm.groups, self.bm.offsets
        swapper = CpuSwapSpace([40] * len(groups), self.offsets) if mode == "swap" else None
        self.budget = rng.choice([4, 7, 16])
        self.scheduler = Scheduler(self.bm, 4, self.budget, mode, swapper)
        self.kv: dict[int, int | None] = {}
        self.cpu: dict[int, int | None] = {}
        self.children: list[Sequence] = []  # n > 1: the second choices, forked

    def _move(
        self, pairs: list[tuple[int, int]], src: dict[int, int | None], dst: dict[int, int | None]
    ) -> None:
        for a, b in pairs:
            for o in range(self.bs):
                dst[b * self.bs + o] = src.get(a * self.bs + o)

    def _slot(self, g: int, seq: Sequence, p: int) -> int:
        group = self.groups[g]
        b = group.block_tables[seq.seq_id][p // self.bs]
        assert b != group.null, f"position {p} of a group of window {group.window} has no block"
        assert group.ref_counts[b] > 0, "a block the sequence reads is free"
        return (self.offsets[g] + b) * self.bs + p % self.bs

    def step(self) -> None:
        for seq in self.scheduler.running:
            seq.draft_token_ids.clear()
            if seq.num_uncomputed == 1 and seq.output_token_ids and self.rng.random() < 0.5:
                ctx: list[int] = list(seq.token_ids)
                for _ in range(self.rng.randrange(1, 5)):
                    ok = self.rng.random() < 0.6
                    seq.draft_token_ids.append(truth(ctx) if ok else self.rng.randrange(VOCAB))
                    ctx.append(seq.draft_token_ids[-1])
        out = self.scheduler.schedule()
        self._move(out.swap_out, self.kv, self.cpu)
        self._move([(c, d) for d, c in out.swap_in], self.cpu, self.kv)  # (device, cpu) pairs
        for src, dst in out.copies:
            self._move([(src, dst)], self.kv, self.kv)
        output = ModelOutput()
        for seq, n in out.scheduled:
            start, tokens = seq.num_computed_tokens, list(seq.token_ids) + seq.draft_token_ids
            for g in range(len(self.groups)):
                for p in range(start, start + n):
                    self.kv[self._slot(g, seq, p)] = tokens[p]
            for g, group in enumerate(self.groups):  # what this step's queries read, every layer
                lo = max(0, start - group.window + 1) if group.window else 0
                for p in range(lo, start + n):
                    assert self.kv[self._slot(g, seq, p)] == tokens[p], (
                        "a block a layer reads was overwritten"
                    )
            if start + n >= seq.num_tokens:
                rows = [truth(tokens[: p + 1]) for p in range(seq.num_tokens - 1, start + n)]
                output.sampled.append(Sampled(seq, rows, [None] * len(rows)))
                if seq.params.n > 1 and not seq.output_token_ids and not seq.draft_token_ids:
                    child = Sequence(seq.request_id, 1, seq.prompt_token_ids, seq.params, 0.0)
                    output.sampled.append(Sampled(child, rows[:1], [None], seq))
                    self.children.append(child)
        self.scheduler.update_from_output(out, output)
        self.bm.check_invariants()
        for seq, _ in out.scheduled:  # a windowed table holds its window's blocks only
            for group in self.groups:
                table = group.block_tables.get(seq.seq_id)
                if table is not None and group.window:
                    start = group.window_start(seq.num_computed_tokens)
                    assert all(b == group.null for b in table[:start])
                    assert all(b != group.null for b in table[start:])


def _run(seed: int, windows: list[int], bs: int, mode: str) -> tuple[int, int]:
    """One random run: every sequence generates what it would alone; nothing leaks. Returns
    (preemptions, forks)."""
    rng = random.Random(seed)
    sizes = [rng.randrange(10, 30) if w == 0 else rng.randrange(9, 20) for w in windows]
    stand = Stand(rng, windows, bs, sizes, mode)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    seqs: list[Sequence] = []
    for step in range(600):
        if len(seqs) < 8 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(5))]
            params = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True, n=rng.choice([1, 1, 2]))
            if stand.bm.fits(len(prompt) + params.max_tokens, stand.budget):
                seqs.append(Sequence(f"r{len(seqs)}", 0, prompt, params, float(step)))
                stand.scheduler.add(seqs[-1])
        stand.step()
        if len(seqs) == 8 and not stand.scheduler.has_unfinished():
            break
    assert not stand.scheduler.has_unfinished()
    for seq in seqs + stand.children:
        want: list[int] = []
        for _ in range(seq.params.max_tokens):
            want.append(truth(seq.prompt_token_ids + want))
        assert seq.output_token_ids == want, seq.request_id
    for group in stand.groups:
        assert group.num_free_blocks == group.num_usable_blocks, "blocks leaked"
    return stand.scheduler.num_preemptions, len(stand.children)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    windows=st.sampled_from([[0, 3], [0, 6], [0, 5, 9], [7]]),
    bs=st.sampled_from([2, 4]),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_random_schedules_never_free_a_block_a_layer_reads(
    seed: int, windows: list[int], bs: int, mode: str
) -> None:
    _run(seed, windows, bs, mode)


def test_the_property_run_preempts_and_forks() -> None:
    """The stand-in's runs do reach what the property is about (on fixed seeds)."""
    preempted = forked = 0
    for seed, mode in ((0, "recompute"), (1, "swap")):
        p, f = _run(seed, [0, 5], 2, mode)
        preempted, forked = preempted + p, forked + f
    assert preempted > 0 and forked > 0


# -- the Gemma 3 shape at 16k ------------------------------------------------------------


def test_a_gemma3_shaped_model_at_16k_context_holds_under_0_3x_full_attentions_kv() -> None:
    """Gemma-3-4B's layers (34: every sixth full, the others windowed over 1,024 tokens), a
    16,384-token prompt prefilled in 512-token chunks by the real scheduler, then 64 decodes;
    the bytes held are the block managers' used blocks at their group's block bytes
    (kv_bytes_used, what EngineStats.kv_bytes_used reports)."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34))
    mc = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,  # Gemma-3-4B's attention; the rest is tiny, its KV per token is the real one
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        sliding_window=1024,
        layer_types=types,
    )
    groups = kv_groups(mc)
    assert [(g.window, len(g.layers)) for g in groups] == [(0, 5), (1024, 29)]
    bs, chunk, prompt, new = 16, 512, 16384, 64
    sizes = split_blocks(groups, (prompt + new) // bs + 8, bs, 1, chunk)
    bm = HybridBlockManager(groups, sizes, bs)
    per_block = group_block_bytes(mc, groups, bs, torch.bfloat16)
    sched = Scheduler(bm, 1, chunk)
    seq = Sequence("r", 0, [1] * prompt, SamplingParams(max_tokens=new, ignore_eos=True), 0.0)
    sched.add(seq)
    held: list[int] = []  # each step's, its blocks reserved
    while sched.has_unfinished():
        out = sched.schedule()
        held.append(kv_bytes_used(bm, per_block))
        output = ModelOutput()
        output.sampled = [
            Sampled(s, [7], [None]) for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens
        ]
        sched.update_from_output(out, output)
    assert len(held) == prompt // chunk + new - 1  # the prompt's chunks, then a decode a token
    full_attention = bytes_per_block(mc, bs, torch.bfloat16) * bm.blocks_for(prompt + new)
    at_16k, peak = held[-1], max(held)  # the last decode reads 16,447 tokens of context
    assert at_16k <= 0.3 * full_attention, at_16k / full_attention
    assert peak <= 0.3 * full_attention, peak / full_attention  # prefill chunks included
    assert kv_bytes_used(bm, per_block) == 0
