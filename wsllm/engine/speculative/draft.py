"""`--speculative draft --draft-model PATH`: drafts from a smaller model run in this engine.

The draft model (an HF directory or a GGUF, with the target's tokenizer: the vocabularies
must be the same size) is built like the target, on its device and in its dtype, with a
KV cache of its own holding as many tokens as the target's. Each target sequence that
drafts has a shadow sequence in the draft model: its tokens are the target's, its KV the
draft model's. A proposal first catches the shadow up with the target (the tokens the
target kept since its last proposal: one or two; the whole prompt the first time), then
runs the draft model greedily, one token a pass, for the most drafts any sequence asked
for; a shadow stops once it has its own number. Drafting greedily makes each draft certain
(q one-hot), so verification is the same exact rule as for n-gram drafts (the package's docstring).

After verification the shadow keeps the tokens the target kept: its KV past them (the
rejected drafts) is dropped, the blocks that held only those go back to its pool. A
shadow whose sequence stopped running (finished, aborted, preempted) is freed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from wsllm.engine.block_manager import BlockManager
from wsllm.engine.cache_engine import CacheEngine, kv_cache_dtype
from wsllm.engine.model_runner import ModelRunner
from wsllm.engine.sequence import Sequence
from wsllm.types import SamplingParams

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)  # a shadow drafts greedily, whatever its target samples by


def load_draft(config: Any, target_vocab: int) -> Any:
    """The draft model for an engine of `config` (--draft-model), built as the target is.
    Refuses one whose vocabulary differs from the target's (not the same tokenizer)."""
    from wsllm.models.build import build_model

    cfg = dataclasses.replace(config, model=config.draft_model, speculative="off", draft_model=None)
    built = build_model(cfg)
    vocab = built.model.config.vocab_size
    if vocab != target_vocab:
        raise ValueError(
            f"the draft model {config.draft_model!r} has a vocabulary of {vocab} tokens, the target "
            f"{target_vocab}: a draft model must share the target's tokenizer"
        )
    log.info("draft model %s loaded for speculative decoding", built.name)
    return built.model


class DraftProposer:
    """Shadows of the target's sequences in the draft model, and the passes that draft."""

    cheap = False  # the policy picks each sequence's k first; only those are drafted

    def __init__(self, model: Any, num_tokens: int, block_size: int) -> None:
        params = next(model.parameters())
        dtype, _ = kv_cache_dtype("auto", params.dtype, params.device)
        num_blocks = max(1, -(-num_tokens // block_size))
        self.cache = CacheEngine(model.config, num_blocks, block_size, dtype, params.device)
        self.bm = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(model, self.cache.kv_caches, block_size, params.device)
        self.vocab_size = model.config.vocab_size
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow
        self._synced: dict[int, int] = {}  # target seq_id -> its outputs the shadow holds as they are

    def propose(self, seqs: list[Sequence], most: list[int]) -> list[list[int]]:
        """Up to most[i] greedy draft tokens for each of `seqs`."""
        want: list[tuple[Sequence, Sequence, int]] = []  # (target, shadow, k)
        for seq, k in zip(seqs, most, strict=True):
            if k > 0 and (shadow := self._sync(seq)) is not None:
                want.append((seq, shadow, k))
        for step in range(max((k for _, _, k in want), default=0)):
            live = [(s, sh) for s, sh, k in want if k > step and self._room(sh)]
            if not live:
                break
            self._draft_pass([sh for _, sh in live])
        out: dict[int, list[int]] = {}
        for seq, shadow, k in want:
            have = len(seq.output_token_ids)
            out[seq.seq_id] = shadow.output_token_ids[have : have + k]
        return [out.get(seq.seq_id, []) for seq in seqs]

    def release(self, alive: set[int]) -> None:
        """Free the shadows of sequences no longer running (aborted, preempted)."""
        self.forget([i for i in self._shadows if i not in alive])

    def forget(self, seq_ids: list[int]) -> None:
        """Free the shadows of these sequences (finished)."""
        for seq_id in seq_ids:
            if (shadow := self._shadows.pop(seq_id, None)) is not None:
                self.bm.free(shadow.seq_id)
                del self._synced[seq_id]

    # -- shadows -------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence | None:
        """The shadow of `seq` with the target's tokens: what it drafted and the target
        rejected is dropped, with its KV; None when the draft cache has no room for it."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            if not self.bm.can_allocate(seq.token_ids, use_cache=False):
                return None
            shadow = Sequence(seq.request_id, seq.index, seq.prompt_token_ids, _GREEDY, seq.arrival_time)
            self.bm.allocate(shadow.seq_id, seq.token_ids, seq.num_tokens, use_cache=False)
            self._shadows[seq.seq_id] = shadow
        mine, theirs = shadow.output_token_ids, seq.output_token_ids
        same = self._synced.get(seq.seq_id, 0)  # before it, the drafts it kept: the same
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        del mine[same:]
        mine.extend(theirs[same:])
        self._synced[seq.seq_id] = len(theirs)
        # the last token runs again (its KV is kept as it is): its logits give the first draft
        kept = min(len(seq.prompt_token_ids) + same, shadow.num_tokens - 1)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, kept)
        self.bm.trim(shadow.seq_id, shadow.num_tokens)
        return shadow

    def _room(self, shadow: Sequence) -> bool:
        """Blocks for the shadow's uncomputed tokens (all or none)."""
        return self.bm.ensure_slots(shadow.seq_id, shadow.num_tokens)

    @torch.inference_mode()
    def _draft_pass(self, shadows: list[Sequence]) -> None:
        """One pass of the draft model: each shadow computes its uncomputed tokens and
        takes its greedy next token."""
        scheduled = [(sh, sh.num_uncomputed) for sh in shadows]
        out = self.runner.run(scheduled, self.bm.block_tables)
        assert len(out.sampled) == len(shadows)
        for s in out.sampled:
            s.seq.num_computed_tokens = s.seq.num_tokens
            s.seq.output_token_ids.append(s.token_ids[0])
