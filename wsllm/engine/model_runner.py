"""Model runner: turns the scheduler's `{seq: num_new_tokens}` into packed tensors,
runs the model once over every token of the step, and returns next-token logits
where a sequence has caught up with its tokens, and the logprobs of prompt tokens for
the sequences that ask for them.

Inputs are built in one pass over the scheduled sequences, without concatenating a
sequence's prompt and output: a decode row reads its last token, a prompt chunk
slices only the tokens it computes. Logits are computed only for the rows that
sample (a prompt chunk that has not caught up needs none).

Prompt logprobs: the row of position p predicts prompt token p + 1, so a chunk over
positions [start, end) gives the entries of tokens start + 1 .. end (those in the
prompt). They are reduced on the device, a slice of rows at a time, to the chosen token's
logprob and the top N: a [prompt, vocab] logits tensor is never held whole.

Pooling (embedding requests): their rows never reach the LM head. A chunk hands back the
fp32 sum of its hidden states (`mean`, summed over chunks by the request) or, in the step
where the sequence catches up, its last row (`last`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wsllm import kernels
from wsllm.engine.sequence import Sequence
from wsllm.engine.static_step import StaticStep
from wsllm.models.causal_lm import CausalLM
from wsllm.models.layers.attention import AttentionMetadata
from wsllm.models.lora import LoraBatch

# Rows of [rows, vocab] fp32 logits reduced at once: 2**21 floats (8 MiB, 42 rows of a 49k
# vocabulary) per slice. The slice stays in the last-level cache through its passes (gather,
# top-k, max, exp, sum), is reused from the heap rather than mapped afresh, and is still
# wide enough that the LM head's kernel reads its weights once for many rows.
_LOGPROB_SLICE_FLOATS = 1 << 21
_LOGPROB_SLICE_MIN_ROWS = 16  # a large vocabulary: fewer rows would read the LM head too often


@dataclass(slots=True)
class PromptLogprobs:
    seq: Sequence
    first: int  # the prompt position of entries[0] (>= 1: the first prompt token has none)
    entries: list[Any]  # per prompt token: (logprob, ((tok, lp), ...top N)): tuples, see _token_logprobs


@dataclass(slots=True)
class Pooled:
    seq: Sequence
    start: int  # the first position of this step's chunk
    num_tokens: int  # positions in the chunk
    caught_up: bool  # the chunk ends at the sequence's last token
    vector: torch.Tensor  # [hidden] fp32, CPU: the chunk's sum (mean) or its last row (last)


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a device tensor. On CUDA through pinned memory, asynchronously: a plain
    copy would first wait for the forward queued before it."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        static: StaticStep | None = None,  # decode-only steps over padded static inputs
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.dtype = next(model.parameters()).dtype  # the activations'
        self.kv_dtype = kv_caches[0][0].dtype  # may be narrower (kv_cache_dtype)
        self.static = static
        if static is not None:
            static.bind(kv_caches)  # on CUDA: captures its graphs now

    def _prepare(
        self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[list[int]]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        rows: list[int] = []  # scheduled rows that caught up with their tokens: they sample
        sample_at: list[list[int]] = []  # per such row, the packed rows it samples at
        tables: list[list[int]] = []
        for i, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + n
            table = block_tables[seq.seq_id]
            drafts = end - seq.num_tokens  # > 0: the last token and this many drafts to verify
            caught_up = drafts >= 0
            if n == 1:  # decode: one token, usually the last one
                input_ids.append(seq.last_token_id if caught_up else seq.token_ids[start:end][0])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if drafts > 0:
                    input_ids.extend(seq.token_ids[start:] + seq.draft_token_ids[:drafts])
                else:
                    input_ids.extend(seq.token_ids[start:end])
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if caught_up:  # a verifying row samples at its last token and at every draft
                rows.append(i)
                sample_at.append(list(range(starts[-1] - 1 - drafts, starts[-1])))
            tables.append(table)
        # Only the blocks this step reads: ceil(longest context / block size) columns.
        width = (max(seq_lens) + bs - 1) // bs
        bt = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            row = t[:width]
            bt[i, : len(row)] = row
        dev = self.device
        q_lens = [n for _, n in scheduled]
        max_q = max(q_lens)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
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
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            block_tables=torch.from_numpy(bt).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max_q,
            is_decode=max_q == 1,
            max_seq_len=max(seq_lens),
            cpu_plan=plan,
            lora=LoraBatch.build([seq.lora for seq, _ in scheduled], q_lens, dev),
        )
        return ids, pos_t, meta, rows, sample_at

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_tables: dict[int, list[int]],
        prompt_logprobs: dict[int, int] | None = None,  # seq_id -> top N, for those that want them
        pooling: dict[int, str] | None = None,  # seq_id -> "last" | "mean": embedding requests
    ) -> tuple[list[Sequence], torch.Tensor | None, list[PromptLogprobs], list[Pooled]]:
        """Forward every scheduled token. Returns the sequences that caught up with
        their tokens (embedding requests aside), their next-token logits [num_sampled,
        vocab] (fp32, CPU; a sequence that verifies k drafts has k + 1 rows, in order), the
        prompt logprobs this step computed for the sequences in `prompt_logprobs`, and the
        pooled chunks of the sequences in `pooling`."""
        if self.static is not None and not prompt_logprobs and not pooling and self.static.takes(scheduled):
            return [seq for seq, _ in scheduled], self.static.run(scheduled, block_tables), [], []
        ids, pos, meta, rows, sample_at = self._prepare(scheduled, block_tables)
        hidden = self.model(ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]
        prompt = self._prompt_logprobs(hidden, scheduled, prompt_logprobs) if prompt_logprobs else []
        pooled: list[Pooled] = []
        if pooling:
            pooled = self._pool(hidden, scheduled, pooling)
            keep = [k for k, i in enumerate(rows) if scheduled[i][0].seq_id not in pooling]
            rows, sample_at = [rows[k] for k in keep], [sample_at[k] for k in keep]
        if not rows:
            return [], None, prompt, pooled
        last_index = [r for at in sample_at for r in at]
        if len(last_index) < hidden.shape[0]:  # skip the rows that do not sample
            hidden = hidden[_on_device(last_index, hidden.device)]
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
        return [scheduled[i][0] for i in rows], logits.cpu(), prompt, pooled

    def _pool(
        self, hidden: torch.Tensor, scheduled: list[tuple[Sequence, int]], pooling: dict[int, str]
    ) -> list[Pooled]:
        """Each pooled sequence's chunk reduced on the device, then one copy to the CPU."""
        found: list[tuple[Sequence, int, bool]] = []
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
                found.append((seq, n, caught_up))
            offset += n
        if not vectors:
            return []
        host = torch.stack(vectors).cpu()  # [num_pooled, hidden]
        return [
            Pooled(seq, seq.num_computed_tokens, n, caught_up, host[i])
            for i, (seq, n, caught_up) in enumerate(found)
        ]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, scheduled: list[tuple[Sequence, int]], want: dict[int, int]
    ) -> list[PromptLogprobs]:
        out = []
        offset = 0  # the sequence's first row in the packed batch
        for seq, n in scheduled:
            top = want.get(seq.seq_id)
            start = seq.num_computed_tokens
            stop = min(start + n, len(seq.prompt_token_ids) - 1)  # rows that predict a prompt token
            if top is not None and stop > start:
                targets = seq.prompt_token_ids[start + 1 : stop + 1]
                entries = self._token_logprobs(hidden[offset : offset + stop - start], targets, top)
                out.append(PromptLogprobs(seq, start + 1, entries))
            offset += n
        return out

    def _token_logprobs(self, hidden: torch.Tensor, targets: list[int], top: int) -> list[Any]:
        """[logprob of targets[i], top `top` (token, logprob)] for each row of hidden [rows, hidden].

        A row's cost is its LM-head row (a decode's logits; the rest of the forward is the
        row's own token) and a few passes over its logits: logprob = logit - logsumexp, so
        the chosen token's logit is gathered and the top N taken from the logits themselves
        (log_softmax is monotonic in a row), then the logsumexp is computed in place
        (max, exp, sum: no [rows, vocab] copy), and each slice's numbers come back to
        Python in one `.tolist()` for the values and one for the top ids.

        Each row is a tuple of numbers and tuples: the collector stops tracking those at its
        first pass over them, where lists (21 per row) stay tracked for as long as the table
        lives, the request's whole prefill and reply. 1,500 rows of a top 20 were 33,000
        tracked objects as lists, 3,300 as tuples after one collection, and every full
        collection of a server under such requests walks them all (bench/amplification.py's
        trace: generation-2 collections of up to 108 ms that freed nothing)."""
        vocab = self.model.config.vocab_size
        step = max(_LOGPROB_SLICE_MIN_ROWS, _LOGPROB_SLICE_FLOATS // vocab)
        top = min(top, vocab)
        tgt = torch.tensor(targets, dtype=torch.long, device=hidden.device)[:, None]  # [rows, 1]
        entries: list[Any] = []
        for a in range(0, len(targets), step):
            logits = self.model.compute_logits(hidden[a : a + step])[:, :vocab]  # [s, vocab] fp32
            picked = logits.gather(1, tgt[a : a + step])  # [s, 1]
            top_i = None
            if top:
                top_v, top_i = logits.topk(top, dim=-1)  # [s, top]
                picked = torch.cat([picked, top_v], dim=1)  # [s, 1 + top]
            peak = logits.amax(dim=-1, keepdim=True)  # [s, 1]
            lse = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True).log_().add_(peak)  # logits spent
            values = picked.sub_(lse).tolist()
            if top_i is None:
                entries += [(v[0], ()) for v in values]
                continue
            for v, ids in zip(values, top_i.tolist(), strict=True):
                entries.append((v[0], tuple(zip(ids, v[1:], strict=True))))
        return entries
