"""The rotary tables a model's layers read (`rotary_cache`) and the order of q's and k's rows that
partial rotary needs (`qkv_row_order`).

Every attention path (the torch reference, Triton, the CPU block and the decode stack) rotates the
pairs (i, i + head_dim / 2) of each head by a [max_pos, head_dim] table of cos | sin halves. The
families' differences are tables, not kernels:

- **Per-layer bases** (Gemma 3: 10k on the sliding layers, 1M with linear scaling on the full
  ones) and **NoPE layers** (SmolLM3) are tables of their own: `LayerSpec.rope` names a layer's
  ("global", "local", "none": cos 1, sin 0, which leaves q and k exactly as they are). A model
  whose layers all read one table has it [max_pos, head_dim]; one with several stacks them
  [tables, max_pos, head_dim] in `rope_tables` order (kernels/cpu_attention_plan.py reads either).
- **Partial rotary** (Phi-4-mini: the first 3/4 of each head turn, HF pairs (i, i + rotary_dim /
  2)): q's and k's rows of each head are reordered once, as the weights load, so that HF's pairs
  become the kernels' (i, i + head_dim / 2) and the dimensions rotary leaves alone pair with each
  other under cos 1, sin 0. q . k is a sum over a head's dimensions, so the same order on q and
  on k changes no score; V and the output are not touched.
- **LongRoPE** (Phi-3): kernels/rotary.py's `longrope_cos_sin_cache`.
"""

from __future__ import annotations

import torch

from wsllm import kernels
from wsllm.models.config import ROPES, ModelConfig


def rope_tables(c: ModelConfig) -> list[str]:
    """The rotary tables the layers of `c` read, in ROPES order (a layer's index in it: its table's)."""
    used = {c.layer(i).rope for i in range(c.num_layers)}
    return [r for r in ROPES if r in used]


def _table(c: ModelConfig, kind: str) -> torch.Tensor:
    """One table [max_pos, head_dim]: the rotary dimensions' cos | sin, identity on the rest."""
    rot, half = c.rotary_dim, c.head_dim // 2
    n = c.max_position_embeddings
    if kind == "none":
        return torch.cat([torch.ones(n, half), torch.zeros(n, half)], dim=1)
    if kind == "local":
        cs = kernels.compute_cos_sin_cache(rot, c.rope_local_theta, n, None)
    else:
        cs = kernels.compute_cos_sin_cache(rot, c.rope_theta, n, c.rope_scaling)
    if rot == c.head_dim:
        return cs
    pad = half - rot // 2
    cos, sin = cs[:, : rot // 2], cs[:, rot // 2 :]
    return torch.cat([cos, torch.ones(n, pad), sin, torch.zeros(n, pad)], dim=1)


def rotary_cache(c: ModelConfig) -> torch.Tensor:
    """The model's rotary tables on the CPU, fp32: [max_pos, head_dim] when every layer reads one,
    else [len(rope_tables(c)), max_pos, head_dim]."""
    with torch.device("cpu"):  # even while the model is built on the meta device (CausalLM)
        tables = [_table(c, kind) for kind in rope_tables(c)]
    return tables[0] if len(tables) == 1 else torch.stack(tables)


def head_order(c: ModelConfig) -> torch.Tensor | None:
    """Where each of a head's dimensions comes from under partial rotary ([head_dim] int64: the
    first half of the rotary dimensions, the first half of the rest, the second halves), or None
    when rotary turns the whole head."""
    rot, d = c.rotary_dim, c.head_dim
    if rot == d:
        return None
    h, p = rot // 2, (d - rot) // 2
    return torch.cat(
        [torch.arange(0, h), torch.arange(rot, rot + p), torch.arange(h, rot), torch.arange(rot + p, d)]
    )


def qkv_row_order(c: ModelConfig) -> torch.Tensor | None:
    """The fused q|k|v projection's rows in the order the kernels pair them ([q + 2 kv] int64:
    each head of q and of k reordered by `head_order`, v as it is); None: no reordering. It maps
    q's rows to q's and k's to k's, so a part's rows (start, size) take order[start:start + size]
    - start."""
    order = head_order(c)
    if order is None:
        return None
    d = c.head_dim
    q_heads = [order + h * d for h in range(c.num_heads)]
    k_heads = [order + (c.num_heads + h) * d for h in range(c.num_kv_heads)]
    v = torch.arange((c.num_heads + c.num_kv_heads) * d, (c.num_heads + 2 * c.num_kv_heads) * d)
    return torch.cat([*q_heads, *k_heads, v])


def layer_rope(c: ModelConfig, layer: int) -> int:
    """Layer `layer`'s table: its index in `rope_tables(c)`."""
    return rope_tables(c).index(c.layer(layer).rope)
