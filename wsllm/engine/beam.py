"""Beam search over shared KV blocks.

The beams of a request are sequences. Each step, the top candidates over all
beams are chosen the way Hugging Face `generate(num_beams=...)` chooses them; a
beam that continues in several ways is forked (its blocks shared by reference
count, copied on write), and a beam that does not continue is freed.

The selection rules mirror transformers' beam search: keep the top
`max(2, 1 + num_eos) * width` candidates by summed log-probability; the best
`width` that did not stop keep running; those among the first `width` that did
stop enter the finished set, scored `sum_logprob / generated_len ** length_penalty`;
the search ends when no running beam can beat the worst finished one (the
`early_stopping=False` heuristic) or, with `early_stopping=True`, as soon as
`width` hypotheses have finished.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from wsllm.engine.scheduler import Scheduler
from wsllm.engine.sequence import SeqStatus, Sequence

NEG = -1.0e9


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    score: float  # length-normalised
    stopped_by_eos: bool


@dataclass(slots=True)
class Candidate:
    beam: int  # index into the running beams
    token: int
    logprob: float  # summed over the beam's tokens
    hits_stop: bool


@dataclass(slots=True)
class BeamState:
    width: int
    length_penalty: float
    early_stopping: bool
    max_tokens: int
    eos_ids: list[int]
    scores: list[float] = field(default_factory=lambda: [0.0])  # per running beam
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False
    generated: int = 0  # tokens generated so far by every running beam

    def step(self, logits: torch.Tensor, outputs: list[list[int]]) -> list[Candidate]:
        """One search step. logits: [num_beams, vocab] for the running beams (in the
        order of `scores`); outputs: each beam's generated tokens so far.
        Returns the candidates that keep running (best first)."""
        lp = torch.log_softmax(logits.float(), dim=-1) + torch.tensor(self.scores)[:, None]
        vocab = lp.shape[1]
        k = max(2, 1 + len(self.eos_ids)) * self.width
        top_v, top_i = lp.flatten().topk(min(k, lp.numel()))
        g = self.generated + 1  # generated length after this token
        cands = []
        for v, i in zip(top_v.tolist(), top_i.tolist(), strict=True):
            beam, tok = divmod(i, vocab)
            cands.append(Candidate(beam, tok, v, tok in self.eos_ids or g >= self.max_tokens))
        self._update_finished(cands, outputs, g)
        running = sorted((c for c in cands if not c.hits_stop), key=lambda c: c.logprob, reverse=True)[
            : self.width
        ]
        self.generated = g
        self.scores = [c.logprob for c in running]
        self._check_done(cands, running)
        return [] if self.done else running

    def _update_finished(self, cands: list[Candidate], outputs: list[list[int]], g: int) -> None:
        full = len(self.finished) >= self.width
        if (full and self.early_stopping) or not self.improvable:
            return
        for c in cands[: self.width]:  # only the top `width` may finish
            if not c.hits_stop:
                continue
            hyp = Hypothesis(
                outputs[c.beam] + [c.token], c.logprob / (g**self.length_penalty), c.token in self.eos_ids
            )
            self.finished.append(hyp)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _check_done(self, cands: list[Candidate], running: list[Candidate]) -> None:
        full = len(self.finished) >= self.width
        if full and running:
            best_len = self.generated
            best = running[0].logprob / (best_len**self.length_penalty)
            worst = min(h.score for h in self.finished)
            self.improvable = self.improvable and best > worst
        if (
            not self.improvable
            or (full and self.early_stopping)
            or all(c.hits_stop for c in cands)
            or not running
        ):
            self.done = True

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]


class BeamHost(Protocol):
    """What the search needs of an engine's request."""

    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # the running beams
    beam: BeamState | None
    beam_logits: dict[int, torch.Tensor]  # seq_id -> next-token logits, this round


class BeamSearcher:
    """Runs beam-search requests over the scheduler: collects each beam's logits and,
    once every running beam of a request has them, takes one search step (fork the
    beams that continue in several ways, free the ones that stop)."""

    def __init__(self, scheduler: Scheduler, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.vocab_size = vocab_size

    def split(
        self, seqs: list[Sequence], logits: torch.Tensor, requests: Mapping[str, BeamHost]
    ) -> tuple[list[Sequence], torch.Tensor | None, list[BeamHost]]:
        """Take beam rows out of the batch. Returns the other rows, their logits, and
        the requests whose search advanced (check `beam.done`)."""
        keep: list[int] = []
        advanced: list[BeamHost] = []
        for i, seq in enumerate(seqs):
            req = requests.get(seq.request_id)
            if req is None or req.beam is None:
                keep.append(i)
                continue
            req.beam_logits[seq.seq_id] = logits[i]
            if len(req.beam_logits) == len(req.seqs):
                self._advance(req)
                advanced.append(req)
        if len(keep) == len(seqs):
            return seqs, logits, advanced
        rest = logits[torch.tensor(keep, dtype=torch.long)] if keep else None
        return [seqs[i] for i in keep], rest, advanced

    def _advance(self, req: BeamHost) -> None:
        assert req.beam is not None
        beams = req.seqs
        rows = torch.stack([req.beam_logits[s.seq_id] for s in beams])
        req.beam_logits.clear()
        chosen = req.beam.step(rows[:, : self.vocab_size], [s.output_token_ids for s in beams])
        used: set[int] = set()
        new_beams: list[Sequence] = []
        for c in chosen:  # fork first, from the parents' current state
            parent = beams[c.beam]
            if c.beam in used:
                child = Sequence(req.request_id, 0, req.prompt_token_ids, parent.params, parent.arrival_time)
                self.scheduler.fork(parent, child)
                new_beams.append(child)
            else:
                used.add(c.beam)
                new_beams.append(parent)
        for i, seq in enumerate(beams):
            if i not in used:
                self.scheduler.remove(seq)
                seq.status = SeqStatus.FINISHED
        for seq, c in zip(new_beams, chosen, strict=True):
            seq.output_token_ids.append(c.token)
        if new_beams:  # when the search is done none continue; the old beams stay for its output
            req.seqs = new_beams
