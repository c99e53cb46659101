"""The CPU attention's plan (kernels/cpu_attention.py): what every layer of a step shares,
built once per step from the rows' block tables and lengths (see cpu_attention.py for how
each kind of row runs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .cpu_ops import native_cache_pair, native_ext

# A prompt row of this many tokens or fewer (a long prompt's chunk beside running streams, at the
# step pacer's floor) runs each token as a decode row of the native kernel; a step of such rows and
# decodes is then decode-shaped, so the model runs it in its one-call decode stack
# (CausalLM.forward) instead of layer by layer: 16 SmolLM2 streams beside a 4-8 token
# chunk of a 1,500-token prompt, one thread of a 2-core AVX2 EPYC, took a forward of ~95 ms
# against ~115 (alternating runs). Each row reads its whole context, so past a few dozen queries
# at a long context the gather and SDPA (cpu_attention.py) is cheaper (2.96 against 1.81 ms a layer for 32
# queries at 1,500).
SHORT_PROMPT_TOKENS = 16


@dataclass(slots=True)
class PrefillRow:
    q_start: int  # this row's queries are q[q_start:q_end]
    q_end: int
    context: int  # tokens it attends to, its new ones included (the last q_end - q_start)
    blocks: torch.Tensor | None  # [ceil(context / block_size)] int64; None: a fresh prompt
    bias: torch.Tensor | None = None  # [q_len, context]: 0 where a query sees a key, else -inf
    # A short row (SHORT_PROMPT_TOKENS) on the native kernel, a decode row per query: its
    # block table [q_len, blocks] int32 and each query's context [q_len] int32
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    table: Sequence[int] = ()  # its block table's first ceil(context / block_size) entries
    # Built on first use by a layer's variant: a decode row per query (q_tables, q_lens, as
    # tables and lens) for a soft-cap or sinks; per window, (first key position, blocks to
    # gather from it or None for a fresh prompt's own K and V, the mask) for SDPA.
    q_tables: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    windows: dict[int, tuple[int, torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class CpuAttentionPlan:
    num_decodes: int  # rows [0, num_decodes) have one query each and are batched
    decode_index: torch.Tensor | None  # [num_decodes * width] int64: blocks to gather
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, width * block_size]: 0 or -inf
    width: int  # block-table columns the decode rows read
    prefills: list[PrefillRow] = field(default_factory=list)
    # Rotary tables for this step's positions, shared by every layer: x * cos + rot(x) * sin
    # with rot(x) = x rolled by half the head (see rotate()). [num_tokens, 1, head_dim]
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, every slot valid
    # The native decode kernel's inputs (None: the torch version, decode_index and decode_bias)
    decode_tables: torch.Tensor | None = None  # [num_decodes, width] int32
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32
    # (cos, sin) of every rotary table the layers read (a [tables, max_pos, head_dim] cache:
    # wsllm/models/rope.py), a layer's by its index; the first is cos and sin
    rotary: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def cos_sin(self, rope: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Table `rope`'s (cos, sin) for this step's positions."""
        if self.rotary:
            return self.rotary[rope]
        assert rope == 0 and self.cos is not None and self.sin is not None
        return self.cos, self.sin


def plan_cpu_attention(
    tables: Sequence[Sequence[int]],  # per row: its block table (may be longer than needed)
    seq_lens: Sequence[int],  # per row: context length after this step
    q_lens: Sequence[int],  # per row: new tokens this step
    block_size: int,
    dtype: torch.dtype = torch.float32,  # the activations' (q's)
    positions: torch.Tensor | None = None,  # [num_tokens] int64, for the rotary tables
    cos_sin_cache: torch.Tensor | None = None,  # [max_pos, head_dim]: cos | sin halves ([tables, ...]: each)
    slot_mapping: torch.Tensor | None = None,  # [num_tokens] int64, no -1
    kv_dtype: torch.dtype | None = None,  # the cache's; None: dtype
) -> CpuAttentionPlan:
    native = native_decode(dtype, kv_dtype or dtype)
    if native and q_lens and 1 < max(q_lens) <= SHORT_PROMPT_TOKENS:  # decode-shaped: one call a layer
        tables, seq_lens, q_lens = _one_query_per_row(tables, seq_lens, q_lens)
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    index = bias = dtables = dlens = None
    width = 0
    if num_decodes:
        lens = seq_lens[:num_decodes]
        width = (max(lens) + block_size - 1) // block_size
        rows = []
        for t in tables[:num_decodes]:
            row = list(t[:width])
            rows.extend(row + [0] * (width - len(row)))  # padding blocks are masked out
    if num_decodes:
        dlens = torch.tensor(lens, dtype=torch.int32)
    if num_decodes and native:
        dtables = torch.tensor(rows, dtype=torch.int32).view(num_decodes, width)
    elif num_decodes:
        index = torch.tensor(rows, dtype=torch.long)
        pos = torch.arange(width * block_size)
        masked = pos[None, :] >= torch.tensor(lens)[:, None]
        bias = torch.zeros(num_decodes, 1, 1, width * block_size, dtype=dtype)
        bias.masked_fill_(masked[:, None, None, :], -torch.inf)
    prefills = []
    start = num_decodes
    for t, ctx, n in zip(tables[num_decodes:], seq_lens[num_decodes:], q_lens[num_decodes:], strict=True):
        blocks = row_bias = None
        used_table = t[: (ctx + block_size - 1) // block_size]
        if native and n <= SHORT_PROMPT_TOKENS:  # beside a long prompt: the same kernel, the same bits
            row_tables, row_lens = decode_rows(used_table, ctx, n)
            prefills.append(PrefillRow(start, start + n, ctx, None, None, row_tables, row_lens, used_table))
            start += n
            continue
        if n != ctx:
            blocks = torch.tensor(list(used_table))
            # queries are the last n positions: query i sees keys <= ctx - n + i
            row_bias = torch.zeros(n, ctx, dtype=dtype).masked_fill_(
                torch.ones(n, ctx, dtype=torch.bool).triu_(ctx - n + 1), -torch.inf
            )
        prefills.append(PrefillRow(start, start + n, ctx, blocks, row_bias, table=used_table))
        start += n
    cos = sin = None
    rotary: list[tuple[torch.Tensor, torch.Tensor]] = []
    if positions is not None and cos_sin_cache is not None:
        tables = cos_sin_cache if cos_sin_cache.dim() == 3 else cos_sin_cache[None]
        rotary = [_rotary_rows(t, positions) for t in tables]
        cos, sin = rotary[0]
    plan = CpuAttentionPlan(num_decodes, index, bias, width, prefills, cos, sin, slot_mapping, dtables, dlens)
    plan.rotary = rotary if len(rotary) > 1 else []
    return plan


def _rotary_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One table's (cos, sin) [num_tokens, 1, head_dim] at `positions` (see CpuAttentionPlan.cos)."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.index_select(0, positions).float()  # exact; the native op reads fp32
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=1)[:, None, :]
    sin = torch.cat([-cs[:, half:], cs[:, half:]], dim=1)[:, None, :]
    return cos, sin


def _one_query_per_row(
    tables: Sequence[Sequence[int]], seq_lens: Sequence[int], q_lens: Sequence[int]
) -> tuple[list[Sequence[int]], list[int], list[int]]:
    """Every prompt token as a decode row of its own: the query at position p reads the
    context [0, p] through its sequence's block table. Exact causal attention because the
    native block stores every row's K and V before any row attends (rope_store_decode)."""
    out_tables: list[Sequence[int]] = []
    out_lens: list[int] = []
    for t, ctx, n in zip(tables, seq_lens, q_lens, strict=True):
        out_tables += [t] * n
        out_lens += range(ctx - n + 1, ctx + 1)
    return out_tables, out_lens, [1] * len(out_lens)


def decode_rows(table: Sequence[int], ctx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt row's queries as decode rows of the native kernel: tables [n, blocks] int32, lens [n]."""
    used, lens, _ = _one_query_per_row([table], [ctx], [n])
    return torch.tensor([list(u) for u in used], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def native_decode(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether decode rows of this dtype over a cache of kv_dtype (None: the same) go to the
    native kernel: built, float32 or bfloat16 queries, a cache of theirs or a half type."""
    return native_cache_pair(dtype, kv_dtype or dtype) and native_ext() is not None


def window_view(
    row: PrefillRow, window: int, block_size: int, dtype: torch.dtype
) -> tuple[int, torch.Tensor | None, torch.Tensor]:
    """-> (the first key position gathered, the blocks from it (None: a fresh prompt's own K
    and V), the additive mask [q_len, keys]: 0 where query i at ctx - q_len + i sees the key)."""
    n, ctx = row.q_end - row.q_start, row.context
    first = ctx - n
    lo = max(0, first - window + 1) // block_size * block_size
    blocks = None if row.blocks is None else torch.tensor(list(row.table[lo // block_size :]))
    q_pos = torch.arange(first, ctx)[:, None]
    k_pos = torch.arange(lo, ctx)[None, :]
    seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return lo, blocks, torch.zeros(n, ctx - lo, dtype=dtype).masked_fill_(~seen, -torch.inf)
