"""Model runner: turns the scheduler's `{seq: num_new_tokens}` into packed tensors,
runs the model once over every token of the step, and returns next-token logits
where a sequence has caught up with its tokens."""

from __future__ import annotations

import torch

from wsllm.engine.sequence import Sequence
from wsllm.models.llama import AttentionMetadata, LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    def _prepare(
        self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        last_index: list[int] = []  # row of each sequence's last new token
        tables = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            toks = seq.token_ids[start : start + n]
            table = block_tables[seq.seq_id]
            input_ids.extend(toks)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
            last_index.append(starts[-1] - 1)
            tables.append(table)
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        q_lens = [n for _, n in scheduled]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=bt.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(q_lens),
            is_decode=all(n == 1 for n in q_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos_t, meta, last_index

    @torch.inference_mode()
    def run(
        self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]]
    ) -> tuple[list[Sequence], torch.Tensor | None]:
        """Forward every scheduled token. Returns the sequences that caught up with
        their tokens and their next-token logits [num_sampled, vocab] (fp32, CPU)."""
        ids, pos, meta, last_index = self._prepare(scheduled, block_tables)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        rows = [i for i, (seq, n) in enumerate(scheduled) if seq.num_computed_tokens + n == seq.num_tokens]
        if not rows:
            return [], None
        idx = torch.tensor([last_index[i] for i in rows], device=hidden.device)
        logits = self.model.compute_logits(hidden[idx])
        return [scheduled[i][0] for i in rows], logits.cpu()
