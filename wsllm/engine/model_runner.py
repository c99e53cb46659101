"""Model runner: turns the scheduler's `{seq: num_new_tokens}` into packed tensors, runs the
model once over every token of the step, samples every row that caught up with its tokens (the
token stage, sampler.py, on the logits' device) and hands back a `ModelOutput` on the host: the
sampled tokens and their logprobs, the prompt logprobs and pooled vectors this step computed.

Between the forward pass and the step's one copy back nothing reads a device value: every
result is a tensor on the device until `to_host` brings all of them at once (on CUDA, one
non-blocking copy of one packed buffer into pinned memory, then the step's only wait), and the
host's work for the token stage (the grammar's bitmask, the sampling tensors) is done while the
forward runs (tests/unit/test_no_host_stall.py shows it, on the meta device).

Inputs are built in one pass over the scheduled sequences, without concatenating a
sequence's prompt and output: a decode row reads its last token, a prompt chunk
slices only the tokens it computes. Logits are computed only for the rows that
sample (a prompt chunk that has not caught up needs none).

Prompt logprobs (prompt_logprobs.py) come back as [rows, 1 + N] values and [rows, N] ids.

A model of several KV groups (kv_groups.py: layers of different windows) hands one block-table
dict per group: each group gets its own slots, block tables and CPU plan, and each layer reads
its group's (AttentionMetadata.groups).

Images (a model that sees): the engine's encoder step hands the rows image placeholders take and
their positions in the packed step (engine/encoder_step.py); they take those tokens' embeddings
(`CausalLM.forward`'s `image_rows`). Such a step is never a static or fused decode step.

Pooling (embedding requests): their rows never reach the LM head. A chunk hands back the
fp32 sum of its hidden states (`mean`, summed over chunks by the request) or, in the step
where the sequence catches up, its last row (`last`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from wsllm import kernels
from wsllm.engine.logits_processors import to_device
from wsllm.engine.model_output import ModelOutput, Pooled, PromptLogprobs, Sampled
from wsllm.engine.prompt_logprobs import entries, prompt_logprob_parts
from wsllm.engine.sampler import Plan, RowView, Sampler, row_views
from wsllm.engine.sequence import Sequence
from wsllm.engine.static_step import StaticStep
from wsllm.models.causal_lm import CausalLM
from wsllm.models.layers.attention import AttentionMetadata
from wsllm.models.lora import LoraBatch

log = logging.getLogger(__name__)

#: the block tables a step reads: seq_id -> table, or one such dict per KV group (kv_groups.py)
Tables = dict[int, list[int]] | list[dict[int, list[int]]]
#: a step's image rows: (their positions in the packed step [k], rows [k, hidden]; encoder_step.py)
ImageRows = tuple[torch.Tensor, torch.Tensor]


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a device tensor. On CUDA through pinned memory, asynchronously: a plain
    copy would first wait for the forward queued before it."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        static: StaticStep | None = None,  # decode-only steps over padded static inputs
        sampler: Sampler | None = None,  # the token stage (default: greedy rows, no EOS)
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.dtype = next(model.parameters()).dtype  # the activations'
        self.kv_dtype = kv_caches[0][0].dtype  # may be narrower (kv_cache_dtype)
        self.static = static
        self.sampler = sampler or Sampler(model.config.vocab_size, [], 0, device)
        if static is not None:
            static.bind(kv_caches)  # on CUDA: captures its graphs now

    def _prepare(
        self, scheduled: list[tuple[Sequence, int]], block_tables: Tables
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[list[int]]]:
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        rows: list[int] = []  # scheduled rows that caught up with their tokens: they sample
        sample_at: list[list[int]] = []  # per such row, the packed rows it samples at
        for i, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + n
            drafts = end - seq.num_tokens  # > 0: the last token and this many drafts to verify
            caught_up = drafts >= 0
            if n == 1:  # decode: one token, usually the last one
                input_ids.append(seq.last_token_id if caught_up else seq.token_ids[start:end][0])
                positions.append(start)
            else:
                if drafts > 0:
                    input_ids.extend(seq.token_ids[start:] + seq.draft_token_ids[:drafts])
                else:
                    input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if caught_up:  # a verifying row samples at its last token and at every draft
                rows.append(i)
                sample_at.append(list(range(starts[-1] - 1 - drafts, starts[-1])))
        dev = self.device
        q_lens = [n for _, n in scheduled]
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        common = (
            torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
            LoraBatch.build([seq.lora for seq, _ in scheduled], q_lens, dev),
        )
        groups = block_tables if isinstance(block_tables, list) else [block_tables]
        metas = [self._group_meta(scheduled, tables, seq_lens, q_lens, pos_t, common) for tables in groups]
        meta = metas[0]
        if len(metas) > 1:  # a model of several KV groups: each layer reads its group's
            meta.groups = tuple(metas)
        return ids, pos_t, meta, rows, sample_at

    def _group_meta(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_tables: dict[int, list[int]],
        seq_lens: list[int],
        q_lens: list[int],
        pos_t: torch.Tensor,
        common: tuple[torch.Tensor, torch.Tensor, LoraBatch | None],
    ) -> AttentionMetadata:
        """One KV group's attention metadata: its slots, its block tables, its CPU plan."""
        bs = self.block_size
        slots: list[int] = []
        tables: list[list[int]] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, start + n)
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            tables.append(table)
        # Only the blocks this step reads: ceil(longest context / block size) columns.
        width = (max(seq_lens) + bs - 1) // bs
        bt = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            row = t[:width]
            bt[i, : len(row)] = row
        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        plan = None
        if dev.type == "cpu" and kernels.backend() == "auto":
            plan = kernels.plan_cpu_attention(
                tables,
                seq_lens,
                q_lens,
                bs,
                self.dtype,
                pos_t,
                self.model.cos_sin_cache,
                slot_t,
                self.kv_dtype,
            )
        max_q = max(q_lens)
        return AttentionMetadata(
            slot_mapping=slot_t,
            block_tables=torch.from_numpy(bt).to(dev),
            seq_lens=common[0],
            query_start_loc=common[1],
            max_query_len=max_q,
            is_decode=max_q == 1,
            max_seq_len=max(seq_lens),
            cpu_plan=plan,
            lora=common[2],
        )

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_tables: Tables,
        prompt_logprobs: dict[int, int] | None = None,  # seq_id -> top N, for those that want them
        pooling: dict[int, str] | None = None,  # seq_id -> "last" | "mean": embedding requests
        images: ImageRows | None = None,  # the rows image placeholders take (engine/encoder_step.py)
    ) -> ModelOutput:
        """Forward every scheduled token and sample every sequence that caught up with its
        tokens (embedding requests aside: a sequence that verifies k drafts samples k + 1 rows,
        in order; an n > 1 choice forking from it samples its first row too), the prompt
        logprobs of the sequences in `prompt_logprobs` and the pooled chunks of those in
        `pooling`: all on the device, then one copy back."""
        step = self.forward(scheduled, block_tables, prompt_logprobs, pooling, images)
        return self.finish(step, to_host(step.parts, self.device))

    def forward(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_tables: Tables,
        prompt_logprobs: dict[int, int] | None = None,
        pooling: dict[int, str] | None = None,
        images: ImageRows | None = None,
    ) -> DeviceStep:
        """The step's device part: inputs to every result it copies back, reading none."""
        plain = not prompt_logprobs and not pooling and images is None
        if self.static is not None and plain and self.static.takes(scheduled):
            logits = self.static.run(scheduled, block_tables)  # queued; the host prepares meanwhile
            return self._tokens(DeviceStep(*self._token_rows([seq for seq, _ in scheduled])), logits)
        hidden, sampling, sample_at = self.model_pass(scheduled, block_tables, pooling, images)
        return self.after_forward(hidden, scheduled, sampling, sample_at, prompt_logprobs, pooling)

    def model_pass(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_tables: Tables,
        pooling: dict[int, str] | None = None,
        images: ImageRows | None = None,
    ) -> tuple[torch.Tensor, list[Sequence], list[list[int]]]:
        """The forward pass over every scheduled token: hidden states [num_tokens, hidden] (on
        CUDA still being computed), the sequences that sample and, for each, its packed rows."""
        ids, pos, meta, rows, sample_at = self._prepare(scheduled, block_tables)
        if images is not None:
            images = images[0].to(self.device), images[1].to(self.device, self.dtype)
        hidden = self.model(ids, pos, self.kv_caches, meta, images)  # [num_tokens, hidden]
        if pooling:
            keep = [k for k, i in enumerate(rows) if scheduled[i][0].seq_id not in pooling]
            rows, sample_at = [rows[k] for k in keep], [sample_at[k] for k in keep]
        return hidden, [scheduled[i][0] for i in rows], sample_at

    def after_forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        scheduled: list[tuple[Sequence, int]],
        sampling: list[Sequence],  # the sequences that sample
        sample_at: list[list[int]],  # per sampling sequence, its packed rows
        prompt_logprobs: dict[int, int] | None = None,
        pooling: dict[int, str] | None = None,
    ) -> DeviceStep:
        """From the forward's hidden states to the step's results, on their device: the token
        stage's host work first (on CUDA the forward still runs), then every op queued."""
        step = DeviceStep(*self._token_rows(sampling))
        if prompt_logprobs:
            parts, step.prompt = prompt_logprob_parts(self.model, hidden, scheduled, prompt_logprobs)
            step.parts += parts
        if pooling:
            self._pool(step, hidden, scheduled, pooling)
        if not step.rows:
            return step
        at = [r for rows in sample_at for r in rows]
        if len(at) < hidden.shape[0]:  # skip the rows that do not sample
            hidden = hidden[_on_device(at, hidden.device)]
        return self._tokens(step, self.model.compute_logits(hidden))  # [num_sampled, vocab]

    def _token_rows(
        self, sampling: list[Sequence]
    ) -> tuple[list[RowView], list[int], list[_Owner], Plan | None]:
        """The token stage's rows, the logits row each reads, whose samples they are, and their
        plan (the host's part: on CUDA it runs while the forward does)."""
        views: list[RowView] = []
        at: list[int] = []
        owners: list[_Owner] = []
        row = 0
        for seq in sampling:
            mine = row_views(seq)
            owners.append(_Owner(seq, None, len(views), len(mine)))
            views += mine
            at += range(row, row + len(mine))
            for child in seq.forks:  # n > 1: choices forking now, each drawing from this row as itself
                owners.append(_Owner(child, seq, len(views), 1))
                views.append(RowView(child, 0, seq.matcher))
                at.append(row)
            row += len(mine)
        try:
            plan = self.sampler.prepare(views) if views else None
        except Exception:  # noqa: BLE001 - sampled row by row after the copy: a bad row fails alone
            log.warning("preparing the token stage failed; sampling row by row", exc_info=True)
            plan = None
        return views, at, owners, plan

    def _tokens(self, step: DeviceStep, logits: torch.Tensor) -> DeviceStep:
        """The token stage on the logits' device; its tensors go first in the step's copy."""
        if step.at != list(range(logits.shape[0])):  # forks read their first choice's row
            logits = logits[_on_device(step.at, logits.device)]
        step.logits = logits
        if step.plan is not None:
            try:
                drawn = self.sampler.draw(logits, step.plan)
            except Exception:  # noqa: BLE001 - sampled row by row after the copy
                log.warning("batched sampling failed; sampling row by row", exc_info=True)
                step.plan = None
            else:
                step.parts[:0] = drawn
                step.num_drawn = len(drawn)
        return step

    def finish(self, step: DeviceStep, host: list[torch.Tensor]) -> ModelOutput:
        """The step's results on the host (`host`: `step.parts` there) as a ModelOutput."""
        drawn, rest = host[: step.num_drawn], host[step.num_drawn :]
        out = ModelOutput()
        for seq, first, top in step.prompt:
            values, ids = rest.pop(0).tolist(), (rest.pop(0).tolist() if top else None)
            out.prompt_logprobs.append(PromptLogprobs(seq, first, entries(values, ids)))
        if step.pooled:
            vectors = rest.pop(0)  # [num_pooled, hidden] fp32
            out.pooled = [Pooled(seq, s, n, c, vectors[i]) for i, (seq, s, n, c) in enumerate(step.pooled)]
        if not step.rows:
            return out
        failed: dict[int, str] = {}
        if step.plan is not None:
            tokens, logprobs = self.sampler.read(step.plan, drawn)
        else:
            assert step.logits is not None
            tokens, logprobs, failed = self.sampler.sample_isolated(step.logits, step.rows)
        for o in step.owners:
            rows = range(o.first, o.first + o.count)
            s = Sampled(o.seq, [tokens[i] for i in rows], [logprobs[i] for i in rows], o.parent)
            s.error = next((failed[i] for i in rows if i in failed), None)
            if o.seq.beam is not None and s.error is None:
                s.candidates = [(t, v) for t, v in logprobs[o.first][1]]
            out.sampled.append(s)
        return out

    def _pool(
        self,
        step: DeviceStep,
        hidden: torch.Tensor,
        scheduled: list[tuple[Sequence, int]],
        pooling: dict[int, str],
    ) -> None:
        """Each pooled sequence's chunk reduced on the device: [num_pooled, hidden] fp32."""
        vectors: list[torch.Tensor] = []  # each [hidden] fp32
        offset = 0  # the sequence's first row in the packed batch
        for seq, n in scheduled:
            how = pooling.get(seq.seq_id)
            caught_up = seq.num_computed_tokens + n == seq.num_tokens
            if how == "mean":
                vectors.append(hidden[offset : offset + n].float().sum(dim=0))
            elif how == "last" and caught_up:
                vectors.append(hidden[offset + n - 1].float())
            if how == "mean" or (how == "last" and caught_up):
                step.pooled.append((seq, seq.num_computed_tokens, n, caught_up))
            offset += n
        if vectors:
            step.parts.append(torch.stack(vectors))


@dataclass(slots=True)
class _Owner:
    seq: Sequence  # whose samples rows [first, first + count) are
    parent: Sequence | None  # the choice it forks from in this step (n > 1)
    first: int
    count: int


@dataclass(slots=True)
class DeviceStep:
    """A step's results on the device, and what reads them on the host (`ModelRunner.finish`)."""

    rows: list[RowView]  # the token stage's rows
    at: list[int]  # each row's row of the logits
    owners: list[_Owner]
    plan: Plan | None  # None: the batched token stage failed; sampled row by row after the copy
    logits: torch.Tensor | None = None  # the token stage's, kept for that retry
    parts: list[torch.Tensor] = field(default_factory=list)  # what the step copies back, in order
    num_drawn: int = 0  # of `parts`, the first are the token stage's
    prompt: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, first, top) per chunk
    pooled: list[tuple[Sequence, int, int, bool]] = field(default_factory=list)  # (seq, start, n, caught up)


def to_host(parts: list[torch.Tensor], device: torch.device, pack: bool | None = None) -> list[torch.Tensor]:
    """Every tensor a step hands back, on the host. The CPU's are there already; elsewhere they
    are packed into one float64 buffer (token ids and fp32 values are exact in it), copied once
    without blocking into pinned memory, and the step waits once, there (`pack` forces either way)."""
    if not parts or not (device.type != "cpu" if pack is None else pack):
        return parts
    flat = torch.cat([p.reshape(-1).to(torch.float64) for p in parts])
    pinned = device.type == "cuda"
    host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=pinned)
    host.copy_(flat, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(device).synchronize()  # the step's one wait
    out, at = [], 0
    for p in parts:
        out.append(host[at : at + p.numel()].view(p.shape).to(p.dtype))
        at += p.numel()
    return out
