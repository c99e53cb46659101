"""Speculative decoding and the KV cache, as a property: whatever drafts are proposed and
whichever are rejected, the block manager's invariants hold after every step, no block is
left behind, the prefix cache never hands out a block holding a rejected token, and every
sequence generates what it would without drafts.

A stand-in model writes each input token into its KV slot and predicts the next token from
the last three tokens it reads back from the cache through the block table: a rejected
draft left where a kept token should be, or a corrupted shared block, changes what it
predicts. The scheduler (its update_from_output keeps what each sequence accepted), block
manager and sampler (a verification's rows) are the engine's own."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.model_output import ModelOutput, Sampled
from wsllm.engine.sampler import Sampler, row_views
from wsllm.engine.scheduler import Scheduler
from wsllm.engine.sequence import Sequence
from wsllm.engine.speculative import Speculator
from wsllm.engine.step_cost import StepCost
from wsllm.types import SamplingParams

VOCAB = 12  # few tokens: prompts share prefixes, outputs repeat


def truth(context: list[int]) -> int:
    a, b, c = ([0, 0, 0] + context)[-3:]
    return (a * 7 + b * 3 + c * 5 + len(context) % 2) % VOCAB


class Stand:
    """The engine's step without the model: schedule, 'forward' and sample, update, observe."""

    def __init__(self, num_blocks: int, block_size: int, rng: random.Random) -> None:
        self.bm = BlockManager(num_blocks, block_size, watermark=0.0, enable_prefix_caching=True)
        self.scheduler = Scheduler(self.bm, max_num_seqs=6, max_num_batched_tokens=40)
        self.sampler = Sampler(VOCAB, eos_token_ids=[])
        self.spec = Speculator(None, 8, [], 10_000, StepCost())  # its counters, of the drafts made here
        self.kv: dict[int, int] = {}
        self.rng = rng

    def read(self, seq: Sequence, upto: int) -> list[int]:
        """Tokens at positions [0, upto) as the KV cache holds them for `seq`."""
        table, bs = self.bm.block_tables[seq.seq_id], self.bm.block_size
        return [self.kv[table[p // bs] * bs + p % bs] for p in range(upto)]

    def draft(self, seq: Sequence) -> None:
        """Up to 5 drafts, each the true next token or (often) not."""
        context = list(seq.token_ids)
        drafts: list[int] = []
        for _ in range(self.rng.randrange(6)):
            tok = truth(context + drafts)
            drafts.append(tok if self.rng.random() < 0.7 else self.rng.randrange(VOCAB))
        seq.draft_token_ids[:] = drafts

    def step(self) -> None:
        for seq in self.scheduler.running:
            seq.draft_token_ids.clear()
            if seq.num_uncomputed == 1:
                self.draft(seq)
        out = self.scheduler.schedule()
        rows: list[torch.Tensor] = []
        sampled: list[Sequence] = []
        bs = self.bm.block_size
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            inputs = (list(seq.token_ids) + seq.draft_token_ids)[start : start + n]
            table = self.bm.block_tables[seq.seq_id]
            for p, tok in zip(range(start, start + n), inputs, strict=True):
                self.kv[table[p // bs] * bs + p % bs] = tok
            if start + n >= seq.num_tokens:  # caught up: a row per position from the last token on
                sampled.append(seq)
                for p in range(seq.num_tokens - 1, start + n):
                    rows.append(
                        torch.nn.functional.one_hot(torch.tensor(truth(self.read(seq, p + 1))), VOCAB)
                    )
        output = ModelOutput()
        if sampled:
            logits = torch.stack(rows).float()
            result = self.sampler(logits, [v for seq in sampled for v in row_views(seq)])
            at = 0
            for seq in sampled:
                k = 1 + len(seq.draft_token_ids)
                output.sampled.append(
                    Sampled(seq, result.token_ids[at : at + k], result.logprobs[at : at + k])
                )
                at += k
        update = self.scheduler.update_from_output(out, output)
        assert not update.failed
        self.spec.record(update, [])
        self.bm.check_invariants()
        for seq in self.scheduler.running:  # what the cache holds is what the sequence kept
            assert self.read(seq, seq.num_computed_tokens) == list(seq.token_ids)[: seq.num_computed_tokens]
            # and no block past its tokens: those that held only rejected drafts went back
            assert len(self.bm.block_tables[seq.seq_id]) <= self.bm.blocks_for(seq.num_tokens)


def expected(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(truth(prompt + out))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([2, 4, 8]), num_blocks=st.integers(10, 40))
def test_random_accepts_and_rejects_keep_the_cache_whole(seed: int, block_size: int, num_blocks: int) -> None:
    run(seed, block_size, num_blocks)


def test_the_same_with_preemptions() -> None:
    assert run(seed=0, block_size=2, num_blocks=12) > 0, "a cache this small preempts (by recompute)"


def run(seed: int, block_size: int, num_blocks: int) -> int:
    """One random run; returns how many preemptions it made."""
    rng = random.Random(seed)
    stand = Stand(num_blocks, block_size, rng)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    seqs: list[Sequence] = []
    for step in range(400):
        if len(seqs) < 10 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
            max_tokens = rng.randrange(1, 25)
            if stand.bm.blocks_for(len(prompt) + max_tokens) <= num_blocks:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                seqs.append(Sequence(f"r{len(seqs)}", 0, prompt, params, float(step)))
                stand.scheduler.add(seqs[-1])
        stand.step()
        if len(seqs) == 10 and not stand.scheduler.has_unfinished():
            break
    assert not stand.scheduler.has_unfinished()
    for seq in seqs:
        assert seq.output_token_ids == expected(seq.prompt_token_ids, seq.params.max_tokens), seq.request_id
    assert stand.bm.num_free_blocks == num_blocks, "a block was left behind"
    assert 0 < stand.spec.stats.accepted < stand.spec.stats.drafted
    return stand.scheduler.num_preemptions
