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

from dataclasses import dataclass, field

import torch

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
