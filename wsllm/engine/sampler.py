"""The token stage: every row a step samples, in one batch, on the logits' device.

A row is a sequence as it stands at one position (`RowView`). A decode, or a prompt's last chunk,
is one row. A sequence verifying k drafts has k + 1 rows; row i reads the sequence as if it had
accepted its first i drafts (its output extended by them, its grammar a copy that took them), so
penalties, min_tokens, the grammar's mask and a seeded row's noise are those of that position.
An n > 1 choice that forks in this step samples from its first choice's row as itself (its index,
its seed). A beam asks for its best next tokens instead of a draw. What each sequence keeps is
decided after the step's one copy (`Scheduler.update_from_output`): a plain row is a row with no
drafts, so there is one sample-and-append path.

Three phases, so that a GPU never waits for the host inside a step:

1. `prepare(rows)`, on the host while the forward pass runs (CUDA has queued it): the grammar's
   bitmask (llguidance), the index and value tensors of logit_bias, penalties and min_tokens
   (logits_processors.py), each row's draw parameters, the unseeded rows' uniforms (the batch's,
   from the engine's generator in one call) and the seeded rows' noise (a generator keyed by
   seed, choice index and output position, so their tokens do not depend on the batch and are
   those earlier releases gave), all sent to the device ahead of the ops;
2. `draw(logits, plan)`, on the logits' device, tensor ops only: bias, grammar, penalties,
   min_tokens, the draw (`kernels.sampling`'s distribution: temperature, then top-k, top-p and
   min-p over the whole of it) and the logprobs asked for (log_softmax after bias and mask,
   before penalties and temperature: a token the grammar forbids is never listed). It reads no
   device value back;
3. `read(plan, host)`, once the step's one copy has brought the ids and logprobs back.

The CPU's implementations of the same functions are chosen once, with the device (`native`): the
draw by the native kernel (`kernels.sampling.sample_rows`: no sort of the vocabulary), a plain
greedy batch by numpy's argmax (49,152 fp32 logits in ~8 us against ~80 for torch's: 1.8 ms
against 0.15 at 32 rows) and the grammar's bits unpacked by numpy. Elsewhere the draw is
`device_draw.draw_rows` and everything stays on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from wsllm.engine import logits_processors as lp
from wsllm.engine.device_draw import draw_rows
from wsllm.engine.sequence import Sequence
from wsllm.kernels.sampling import sample_rows

log = logging.getLogger(__name__)


class RowView:
    """A sequence as the sampler reads it at one row: as if it had accepted its first `ahead`
    drafts, with the grammar `matcher` of that position."""

    __slots__ = ("seq", "ahead", "matcher")

    def __init__(self, seq: Sequence, ahead: int = 0, matcher: Any = None) -> None:
        self.seq, self.ahead, self.matcher = seq, ahead, matcher

    @property
    def params(self) -> Any:
        return self.seq.params

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def output_token_ids(self) -> list[int]:
        out = self.seq.output_token_ids
        return out + self.seq.draft_token_ids[: self.ahead] if self.ahead else out

    @property
    def token_ids(self) -> list[int]:
        return [*self.seq.token_ids, *self.seq.draft_token_ids[: self.ahead]]

    @property
    def beam_k(self) -> int:
        """A beam's candidates wanted (its search's), 0 for a row that draws."""
        return self.seq.beam.k if self.seq.beam is not None else 0

    @property
    def top(self) -> int:
        """How many of its best tokens come back with its logprobs."""
        return self.beam_k or (self.params.logprobs or 0)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None or self.seq.beam is not None

    @property
    def greedy(self) -> bool:
        # below types.GREEDY_BELOW a temperature is greedy: dividing by it would overflow the
        # logits into inf / NaN (vLLM uses the same threshold); a beam's draw is unused
        return self.params.greedy or self.seq.beam is not None


def row_views(seq: Sequence) -> list[RowView]:
    """The k + 1 rows of a sequence verifying k drafts (one row without drafts). A structured
    sequence's row i reads a copy of its grammar that has taken the first i drafts (the proposer
    cut the drafts at the first token the grammar refuses, so each copy takes them)."""
    views = [RowView(seq, 0, seq.matcher)]
    matcher = seq.matcher
    for i, tok in enumerate(seq.draft_token_ids, start=1):
        if matcher is not None:
            matcher = matcher.deep_copy()
            matcher.consume_token(tok)
        views.append(RowView(seq, i, matcher))
    return views


def _plain(v: RowView) -> bool:
    p = v.params
    return (
        v.greedy
        and not v.wants_logprobs
        and not lp.needs_penalties(p)
        and len(v.output_token_ids) >= p.min_tokens
        and v.matcher is None
        and not p.logit_bias
    )


def _row_generator(v: RowView) -> torch.Generator:
    """A seeded row's noise stream at its position: keyed by (seed, choice, output length)."""
    seed = v.params.seed or 0
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + v.index * 7_919 + len(v.output_token_ids)) % 2**63)
    return g


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[Any]  # per row: [chosen logprob, [[token, logprob], ... top N]] or None


@dataclass(slots=True)
class Plan:
    """One batch of rows, prepared on the host; every tensor already on the logits' device."""

    rows: list[RowView]
    fast: bool = False  # every row a plain greedy one: the argmax alone
    bias: tuple[torch.Tensor, ...] | None = None
    grammar: tuple[list[int], torch.Tensor] | None = None  # its rows, their allowed tokens [n, vocab]
    penalties: tuple[torch.Tensor, ...] | None = None
    stops: tuple[torch.Tensor, ...] | None = None
    draw: tuple[torch.Tensor, ...] | None = None  # kernels.sampling's arguments; None: all greedy
    want: list[int] = field(default_factory=list)  # rows whose logprobs (or candidates) come back
    want_index: torch.Tensor | None = None


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        seed: int = 0,
        device: torch.device | None = None,
        native: bool | None = None,  # the CPU's implementations; default: on a CPU device
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device or torch.device("cpu")
        self.native = self.device.type == "cpu" if native is None else native
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        # Grammar masks: one row of 32-token words per structured row, reused every step
        # (grown when more rows need one); the executor fills rows in parallel.
        self._bitmask: Any = None
        self._executor: Any = None

    # -- 1. the host's part, while the forward runs --------------------------------------
    def prepare(self, rows: list[RowView]) -> Plan:
        plan = Plan(rows)
        if all(_plain(v) for v in rows):  # the common case: one argmax, nothing else
            plan.fast = True
            return plan
        dev = self.device
        plan.bias = lp.bias_index(rows, dev)
        plan.grammar = self._grammar(rows)
        plan.penalties = lp.penalty_index(rows, dev)
        plan.stops = lp.stop_index(rows, self.eos_token_ids, dev)
        plan.draw = self._draw_args(rows)
        plan.want = [i for i, v in enumerate(rows) if v.wants_logprobs]
        if plan.want:
            plan.want_index = lp.to_device(torch.tensor(plan.want), dev)
        return plan

    def _draw_args(self, rows: list[RowView]) -> tuple[torch.Tensor, ...] | None:
        greedy = [v.greedy for v in rows]
        if all(greedy):
            return None
        ps = [v.params for v in rows]
        temp = torch.tensor([0.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)])
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
        uniform = torch.rand(len(rows), generator=self.generator)  # the unseeded rows' draws, in one call
        seeded = [i for i, (p, g) in enumerate(zip(ps, greedy, strict=True)) if p.seed is not None and not g]
        noise = torch.empty(len(seeded), self.vocab_size)
        noise_row = torch.full((len(rows),), -1, dtype=torch.int64)
        for j, i in enumerate(seeded):  # each seeded row's noise from its own stream
            noise[j].exponential_(generator=_row_generator(rows[i]))
            noise_row[i] = j
        return tuple(
            lp.to_device(t, self.device) for t in (temp, top_k, top_p, min_p, uniform, noise, noise_row)
        )

    def _grammar(self, rows: list[RowView]) -> tuple[list[int], torch.Tensor] | None:
        """The structured rows and the tokens their grammars allow. A matcher in an error state
        allows only EOS, which ends the sequence (the engine then reports the error)."""
        at = [i for i, v in enumerate(rows) if v.matcher is not None]
        if not at:
            return None
        import llguidance
        import llguidance.numpy as llnp

        n = len(at)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = llnp.allocate_token_bitmask(max(n, 8), self.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llnp.fill_next_token_bitmask_par(
            self._executor, [(rows[i].matcher, j) for j, i in enumerate(at)], self._bitmask
        )
        words = self._bitmask[:n]
        if self.native:
            return at, lp.unpack_bits_numpy(words, self.vocab_size)
        # elsewhere the packed words travel (32x fewer bytes) and unpack on the device
        return at, lp.unpack_bits_torch(lp.to_device(torch.from_numpy(words), self.device), self.vocab_size)

    # -- 2. the device's part --------------------------------------------------------------
    def draw(self, logits: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
        """logits [rows, vocab+] (the model may pad its vocabulary: cut here) -> the tensors the
        step copies back: the token ids [rows], and where logprobs are asked for the chosen
        ones' [w], the best ones' values and ids [w, top]. Nothing is read back here."""
        logits = logits[:, : self.vocab_size]
        if plan.fast:
            return [self._argmax(logits)]
        logits = logits.float()
        if plan.bias is not None or plan.grammar is not None:
            logits = logits.clone()  # in place below; a retry row by row starts from the model's
            if plan.bias is not None:
                lp.add_bias(logits, plan.bias)
            if plan.grammar is not None:
                lp.mask_grammar(logits, *plan.grammar)
        raw = logits
        if plan.penalties is not None:
            logits = lp.apply_penalties(logits, plan.penalties)
        if plan.stops is not None:
            logits = lp.mask_stops(logits, plan.stops)
        tokens = self._argmax(logits) if plan.draw is None else self._draw(logits, *plan.draw)
        if plan.want_index is None:
            return [tokens]
        logp = raw[plan.want_index].log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[plan.want_index][:, None]).flatten()
        k = max(plan.rows[i].top for i in plan.want)
        if not k:
            return [tokens, chosen]
        top_v, top_i = logp.topk(min(k, logp.shape[1]), dim=-1)
        return [tokens, chosen, top_v, top_i]

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest entry (a NaN counts as the largest, as in torch.argmax)."""
        if self.native and logits.dtype is torch.float32:
            return torch.from_numpy(logits.numpy().argmax(axis=-1))
        return logits.argmax(dim=-1)

    def _draw(self, logits: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return sample_rows(logits, *args) if self.native else draw_rows(logits, *args)

    # -- 3. the host's part, after the step's one copy -------------------------------------
    def read(self, plan: Plan, host: list[torch.Tensor]) -> tuple[list[int], list[Any]]:
        """The tokens and logprob entries ([chosen, [[token, logprob], ... top N]] or None) of
        each row, from `draw`'s tensors brought to the host."""
        tokens = host[0].tolist()
        logprobs: list[Any] = [None] * len(plan.rows)
        if not plan.want:
            return tokens, logprobs
        chosen = host[1].tolist()
        top_v = host[2].tolist() if len(host) > 2 else None
        top_i = host[3].tolist() if len(host) > 3 else None
        for j, i in enumerate(plan.want):
            n = plan.rows[i].top
            top = []
            if n and top_v is not None and top_i is not None:
                pairs = zip(top_i[j][:n], top_v[j][:n], strict=True)
                top = [[t, v] for t, v in pairs if v != float("-inf")]  # not what a grammar forbids
            logprobs[i] = [chosen[j], top]
        return tokens, logprobs

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[Any]) -> SampleResult:
        """All three phases for a batch, with its own copy back: rows are RowViews or sequences
        (read as they stand). The step runs the phases apart (ModelRunner); a retry row by row,
        the draft model and tests call this."""
        views = [r if isinstance(r, RowView) else RowView(r, 0, r.matcher) for r in rows]
        plan = self.prepare(views)
        return SampleResult(*self.read(plan, [t.cpu() for t in self.draw(logits, plan)]))

    def sample_isolated(
        self, logits: torch.Tensor, rows: list[RowView]
    ) -> tuple[list[int], list[Any], dict[int, str]]:
        """Sample row by row, so that one bad row fails only its own request: each row's token
        (-1 where it failed), logprobs, and {row: reason} for the rows that failed."""
        tokens: list[int] = []
        logprobs: list[Any] = []
        failed: dict[int, str] = {}
        for i, v in enumerate(rows):
            try:
                r = self(logits[i : i + 1], [v])
                t, p = r.token_ids, r.logprobs
            except Exception as e:  # noqa: BLE001 - narrowed to this row
                log.exception("sampling failed for request %s", v.seq.request_id)
                failed[i] = f"sampling failed: {type(e).__name__}"
                t, p = [-1], [None]
            tokens += t
            logprobs += p
        return tokens, logprobs, failed
