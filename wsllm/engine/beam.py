"""Beam search over shared KV blocks.

The beams of a request are sequences. Each step, the token stage hands back each beam's
best next tokens and their logprobs (its `k` candidates: the search's top `k` over all
beams are among them, since a beam's score adds the same to each of its own); once every
running beam has them, the top candidates are chosen the way Hugging Face
`generate(num_beams=...)` chooses them; a beam that continues in several ways is forked
(its blocks shared by reference count, copied on write), and a beam that does not continue
is freed (`advance`, called by `Scheduler.update_from_output` with its own fork and remove).

The selection rules mirror transformers' beam search: keep the top
`max(2, 1 + num_eos) * width` candidates by summed log-probability; the best
`width` that did not stop keep running; those among the first `width` that did
stop enter the finished set, scored `sum_logprob / generated_len ** length_penalty`;
the search ends when no running beam can beat the worst finished one (the
`early_stopping=False` heuristic) or, with `early_stopping=True`, as soon as
`width` hypotheses have finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

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

    @property
    def k(self) -> int:
        """Candidates a step keeps: the top `max(2, 1 + num_eos) * width` (transformers')."""
        return max(2, 1 + len(self.eos_ids)) * self.width

    def step(self, candidates: list[list[tuple[int, float]]], outputs: list[list[int]]) -> list[Candidate]:
        """One search step. candidates: each running beam's best next tokens and their
        logprobs (in the order of `scores`, at least `k` each where the vocabulary has them);
        outputs: each beam's generated tokens so far. Returns the candidates that keep
        running (best first)."""
        # summed in fp32, as a [beams, vocab] tensor of logprobs plus the scores would be;
        # ties to the lower flat index (beam, then token)
        flat = [
            (float(np.float32(v) + np.float32(self.scores[b])), b, tok)
            for b, row in enumerate(candidates)
            for tok, v in row
        ]
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        g = self.generated + 1  # generated length after this token
        cands = [
            Candidate(b, tok, v, tok in self.eos_ids or g >= self.max_tokens) for v, b, tok in flat[: self.k]
        ]
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


@dataclass(slots=True)
class BeamGroup:
    """One request's search: its state, its running beams (the request's `seqs`, the same
    list: it changes in place) and the candidates of the beams that ran this round."""

    state: BeamState
    beams: list[Sequence]
    found: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # seq_id -> candidates

    @property
    def k(self) -> int:
        return self.state.k


def advance(
    group: BeamGroup,
    seq: Sequence,
    candidates: list[tuple[int, float]],
    fork: Callable[[Sequence, Sequence], None],
    remove: Callable[[Sequence], None],
) -> bool:
    """Keep `seq`'s candidates; once every running beam of its group has them, take one
    search step: fork the beams that continue in several ways, free the ones that stop,
    append each chosen token. True when the search took a step (`group.state.done` says
    whether it ended)."""
    group.found[seq.seq_id] = candidates
    beams = group.beams
    if len(group.found) < len(beams):
        return False
    rows = [group.found[s.seq_id] for s in beams]
    group.found.clear()
    chosen = group.state.step(rows, [s.output_token_ids for s in beams])
    used: set[int] = set()
    new_beams: list[Sequence] = []
    for c in chosen:  # fork first, from the parents' current state
        parent = beams[c.beam]
        if c.beam in used:
            child = Sequence(
                parent.request_id, 0, parent.prompt_token_ids, parent.params, parent.arrival_time
            )
            fork(parent, child)
            child.beam = group
            new_beams.append(child)
        else:
            used.add(c.beam)
            new_beams.append(parent)
    for i, s in enumerate(beams):
        if i not in used:
            remove(s)
            s.status = SeqStatus.FINISHED
    for s, c in zip(new_beams, chosen, strict=True):
        s.output_token_ids.append(c.token)
    if new_beams:  # when the search is done none continue; the old beams stay for its output
        beams[:] = new_beams
    return True
