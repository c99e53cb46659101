"""Decode steps over static, bucket-padded inputs: one code path on the CPU and on CUDA.

A decode-only step (every row one token, every row sampling) is padded up to the smallest
batch bucket that holds it (1, 2, 4, 8, 16, 24, 32, then steps of 16 up to `max_num_seqs`)
and runs over buffers allocated once, at the largest bucket's size: token ids, positions,
slot mapping, context lengths, and block tables as wide as the longest context
(`max_model_len`). So a bucket's step has the same shapes and the same addresses every
time: on CUDA its kernels are captured once as a graph and replayed (cuda_graphs.py); on
the CPU the same forward is a plain call, which is how `make test` shows that padding
changes no token. Only the capture and the replay are CUDA's own.

Padded rows: token 0 at position 0, slot -1 (store_kv writes nothing for it), context
length 1 over their block table's first column (a valid block a real row may own: reading
it changes nothing), and their logits are never read. They write no KV and reach no output.

The paged decode kernel plans its split count from shapes only (the bucket and the table's
width), and each row cuts its own context into those splits on the device
(kernels/paged_decode.py): one graph per batch bucket serves every context length.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from wsllm.config import EngineConfig
from wsllm.engine.sequence import Sequence
from wsllm.models.causal_lm import CausalLM
from wsllm.models.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
_BUCKET_STEP = 16  # past 32 rows


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a step is padded to, ascending; the last holds `max_num_seqs`."""
    sizes = [b for b in _SMALL_BUCKETS if b < max_num_seqs]
    sizes += range(32 + _BUCKET_STEP, max_num_seqs, _BUCKET_STEP)
    return [*sizes, max_num_seqs]


def static_mode(config: EngineConfig, device: torch.device) -> str | None:
    """How decode-only steps run: "graphs" (captured and replayed), "plain" (the static,
    padded step as a plain call: the CPU's, or CUDA's under --enforce-eager when asked for
    with --static-decode on) or None (the packed eager step)."""
    if config.static_decode == "off" or (config.static_decode == "auto" and device.type != "cuda"):
        return None
    if device.type == "cuda" and not config.enforce_eager:
        return "graphs"
    return None if config.static_decode == "auto" else "plain"


class StaticInputs:
    """The step's inputs at the largest bucket's size: host staging (pinned on CUDA, so
    the copies are asynchronous) and the device buffers the forward reads. A model of several
    KV groups (kv_groups.py) has a slot mapping and block tables per group."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, num_groups: int = 1) -> None:
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(
                shape, dtype=dtype, device=device
            )

        self.ids = pair((max_batch,), torch.long)  # [B] the token each row computes
        self.positions = pair((max_batch,), torch.long)  # [B]
        self.lens = pair((max_batch,), torch.int32)  # [B] context length, the token included
        # per KV group: [B] the cache slot of each row's token (-1: none), [B, max_blocks] tables
        self.slots = [pair((max_batch,), torch.int64) for _ in range(num_groups)]
        self.tables = [pair((max_batch, max_blocks), torch.int32) for _ in range(num_groups)]
        # [B + 1] one query a row: the same for every step, never copied again
        self.starts = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._all = (self.ids, self.positions, self.lens, *self.slots, *self.tables)
        # numpy views of the staging tensors: per-row writes without a torch call each
        self.np_ids, self.np_pos, self.np_lens = (host.numpy() for host, _ in self._all[:3])
        self.np_slots = [host.numpy() for host, _ in self.slots]
        self.np_tables = [host.numpy() for host, _ in self.tables]

    def fill(
        self,
        scheduled: list[tuple[Sequence, int]],
        tables: dict[int, list[int]] | list[dict[int, list[int]]],  # one dict per KV group
        bucket: int,
        block_size: int,
    ) -> None:
        """Write this step's rows, pad the rest of the bucket, and copy both to the device.
        The copies are queued on the current stream; the staging is written again only
        after the step's one copy back (its sampled ids), which waits for them."""
        ids, pos, lens = self.np_ids, self.np_pos, self.np_lens
        bs = block_size
        groups = tables if isinstance(tables, list) else [tables]
        for i, (seq, _) in enumerate(scheduled):
            p = seq.num_computed_tokens  # the position of the token this step computes
            ids[i] = seq.last_token_id
            pos[i] = p
            lens[i] = p + 1
            w = p // bs + 1
            for group, slots, bt in zip(groups, self.np_slots, self.np_tables, strict=True):
                table = group[seq.seq_id]
                slots[i] = table[p // bs] * bs + p % bs
                bt[i, :w] = table[:w]
        n = len(scheduled)
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        lens[n:bucket] = 1
        for slots in self.np_slots:
            slots[n:bucket] = -1
        for host, dev in self._all:
            dev[:bucket].copy_(host[:bucket], non_blocking=True)

    def pad_all(self, bucket: int) -> None:
        """Every row padding: what warm-up and capture run over (they write no KV)."""
        self.np_ids[:bucket], self.np_pos[:bucket], self.np_lens[:bucket] = 0, 0, 1
        for slots in self.np_slots:
            slots[:bucket] = -1
        for host, dev in self._all:
            dev[:bucket].copy_(host[:bucket])

    def meta(self, bucket: int, max_model_len: int) -> AttentionMetadata:
        metas = [
            AttentionMetadata(
                slot_mapping=slots[1][:bucket],
                block_tables=tables[1][:bucket],
                seq_lens=self.lens[1][:bucket],
                query_start_loc=self.starts[: bucket + 1],
                max_query_len=1,
                is_decode=True,
                max_seq_len=max_model_len,
            )
            for slots, tables in zip(self.slots, self.tables, strict=True)
        ]
        if len(metas) > 1:  # each layer reads its KV group's (AttentionMetadata.groups)
            metas[0].groups = tuple(metas)
        return metas[0]


class StaticStep:
    """Runs decode-only steps over StaticInputs: a plain call, or a CUDA graph's replay."""

    def __init__(
        self,
        model: CausalLM,
        mode: str,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_groups: int = 1,  # the model's KV groups (kv_groups.py)
    ) -> None:
        self.model = model
        self.mode = mode  # "graphs" | "plain"
        self.device = next(model.parameters()).device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.inputs = StaticInputs(self.buckets[-1], max_blocks, self.device, num_groups)
        # [B, vocab] fp32, made by the first forward (a packed or quantized head may pad the
        # vocabulary): every bucket's logits land here, so no graph owns an output
        self.logits: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: Any = None  # cuda_graphs.CudaGraphs once captured
        self.reserved_bytes = 0  # what the graphs will take beyond these buffers (CUDA)
        if mode == "graphs":
            self.reserved_bytes = self._measure_activations()

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def takes(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A decode-only step that fits: each row computes its last token and samples, and
        none runs under a LoRA adapter (the graphs hold none)."""
        return len(scheduled) <= self.buckets[-1] and all(
            n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and seq.lora is None
            for seq, n in scheduled
        )

    def bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Attach the engine's KV cache; with graphs, capture every bucket over it now."""
        self.kv_caches = kv_caches
        if self.mode == "graphs":
            from wsllm.engine.cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs.capture(self.forward, self.inputs.pad_all, self.buckets)

    def forward(self, bucket: int) -> torch.Tensor:
        """The bucket's forward over the static buffers, logits into the static output.
        What a graph captures, and the plain call's whole step."""
        inp = self.inputs
        meta = inp.meta(bucket, self.max_model_len)
        hidden = self.model.forward(inp.ids[1][:bucket], inp.positions[1][:bucket], self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)  # [bucket, vocab]
        if self.logits is None:
            self.logits = logits.new_zeros((self.buckets[-1], logits.shape[1]))
        out = self.logits[:bucket]
        out.copy_(logits)
        return out

    def run(
        self, scheduled: list[tuple[Sequence, int]], tables: dict[int, list[int]] | list[dict[int, list[int]]]
    ) -> torch.Tensor:
        """One decode-only step -> its rows' logits [n, vocab] fp32 on the device: a view of the
        static output, read by this step's token stage before the next step writes it (the
        step's one copy back is of the sampled ids, never of the logits)."""
        n = len(scheduled)
        bucket = self.bucket_for(n)
        self.inputs.fill(scheduled, tables, bucket, self.block_size)
        if self.graphs is not None and self.logits is not None:
            self.graphs.replay(bucket)
            return self.logits[:n]
        return self.forward(bucket)[:n]

    def _measure_activations(self) -> int:
        """Peak memory of one forward at the largest bucket, over a one-block scratch cache
        (every row padding reads block 0): what the graphs' shared pool will hold, counted
        before the KV cache is sized from what is left."""
        c = self.model.config
        shape = (1, self.block_size, c.num_kv_heads, c.head_dim)
        dtype = self.model.embed_tokens.weight.dtype  # on CUDA the cache takes the model's dtype
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]
        top = self.buckets[-1]
        self.inputs.pad_all(top)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self.forward(top)
        torch.cuda.synchronize(self.device)
        assert self.logits is not None  # made by that forward, allocated from now on: not counted again
        peak = torch.cuda.max_memory_allocated(self.device) - base - self.logits.nbytes
        self.kv_caches = []
        log.info(
            "decode graphs: %d buckets up to %d rows, %.0f MiB of activations",
            len(self.buckets),
            top,
            peak / 2**20,
        )
        return int(peak * 1.25) + (64 << 20)  # the pool's rounding and the cuBLAS workspaces


def make_static_step(
    config: EngineConfig, model: CausalLM, max_model_len: int, device: torch.device, num_groups: int = 1
) -> StaticStep | None:
    """The engine's static decode step, or None where decode steps run eagerly. Made before
    the KV cache: on CUDA it measures what its graphs will take (`reserved_bytes`)."""
    mode = static_mode(config, device)
    if mode is None:
        return None
    return StaticStep(model, mode, config.max_num_seqs, max_model_len, config.block_size, num_groups)


__all__ = ["StaticStep", "StaticInputs", "batch_buckets", "make_static_step", "static_mode"]
