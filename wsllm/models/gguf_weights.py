"""A GGUF file's weights in their quantized blocks, under the model's own names.

Linear weights in a format the quantized kernels run (`quant.QTYPES`) stay in their
blocks; everything else (norms, biases, F16/F32 tensors, formats without a kernel)
becomes fp32. llama.cpp stores the rows of Q and K permuted for its rotary layout
(pairs (i, i + d/2) interleaved as (2i, 2i + 1)); that permutation moves whole rows,
so it is undone on the raw rows of blocks, exactly as transformers' GGUF loader undoes
it on de-quantized values. q/k/v and gate/up are fused into one weight where the parts
share a format (a Q4_K_M file mixes Q4_K and Q6_K inside attention: those stay apart).

The repacked weights are cached once beside the converted HF directory, as one
safetensors file of `QuantWeight.state()` tensors plus `index.json`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wsllm.kernels import quant, quant_formats
from wsllm.models.llama import ModelConfig

log = logging.getLogger(__name__)

CACHE_VERSION = 1
# One linear's weight: blocks kept as they are, or an fp32 [rows, in_features] tensor.
LinearPart = quant.QuantWeight | torch.Tensor

# GGUF tensor (in a block) -> (the model's module, which part of it in row order)
_LAYER_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_LAYER_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL = {"token_embd": ("embed_tokens", 0), "output": ("lm_head", 0)}
_SKIPPED = ("rope_freqs",)  # llama3's rotary factors: computed from the config instead


@dataclass(slots=True)
class QuantCheckpoint:
    """A model's weights with its linear layers (and embedding) kept quantized."""

    # module name ("layers.0.self_attn.qkv_proj", "embed_tokens", "lm_head") -> its
    # weight in row order: one part when fused or single, else one per projection
    linears: dict[str, list[LinearPart]] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> fp32 (norms, biases)
    tied: bool = False  # lm_head is embed_tokens' weight (one copy)
    counts: dict[str, int] = field(default_factory=dict)  # GGUF tensors kept quantized, per format

    def describe(self) -> str:
        return ", ".join(f"{k} x {v}" for k, v in sorted(self.counts.items())) or "none"


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (any trailing shape: values or
    raw block bytes): per head, rows [d/2, 2] -> [2, d/2]."""
    n = rows.shape[0]
    half = n // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _target(name: str) -> tuple[str, int, str] | None:
    """GGUF tensor name -> (module or parameter, part index, "weight" | "bias" | "norm")."""
    base, _, kind = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        layer, what = parts[1], parts[2]
        if what in _LAYER_LINEARS:
            mod, i = _LAYER_LINEARS[what]
            return f"layers.{layer}.{mod}", i, kind
        if what in _LAYER_NORMS:
            return f"layers.{layer}.{_LAYER_NORMS[what]}.{kind}", 0, "norm"
    elif base in _GLOBAL:
        mod, i = _GLOBAL[base]
        return mod, i, kind
    elif base == "output_norm":
        return "norm.weight", 0, "norm"
    if base in _SKIPPED:
        return None
    raise KeyError(f"unexpected GGUF tensor {name!r}")


def _as_float(t: Any, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import quants

    return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def read_gguf(path: Path, cfg: ModelConfig) -> QuantCheckpoint:
    """Read `path`'s tensors: linear weights of the kernels' formats as raw rows of
    blocks, the rest as fp32, Q/K rows un-permuted for a llama-architecture file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    permuted = arch_field is not None and arch_field.contents() == "llama"
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    ckpt = QuantCheckpoint()
    raw_parts: dict[str, dict[int, tuple[str, np.ndarray, tuple[int, int]]]] = {}
    biases: dict[str, dict[int, np.ndarray]] = {}
    for t in reader.tensors:
        target = _target(t.name)
        if target is None:
            continue
        mod, idx, kind = target
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        what = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        n_head = heads.get(what) if permuted else None
        qtype = t.tensor_type.name
        if kind == "norm" or kind == "bias":
            v = _as_float(t, shape)
            if n_head:
                v = _unpermute_rows(v, n_head)
            if kind == "norm":
                ckpt.floats[mod] = torch.from_numpy(v.copy())
            else:
                biases.setdefault(mod, {})[idx] = v
            continue
        if qtype in quant.QTYPES and len(shape) == 2:
            raw = np.asarray(t.data).reshape(shape[0], -1)
            ckpt.counts[qtype] = ckpt.counts.get(qtype, 0) + 1
        else:  # a float tensor, or a format without a kernel: fp32
            qtype, raw = "F32", _as_float(t, shape)
        if n_head:
            raw = _unpermute_rows(raw, n_head)
        raw_parts.setdefault(mod, {})[idx] = (qtype, raw, (shape[0], shape[1]))
    for mod, parts in raw_parts.items():
        ckpt.linears[mod] = _fuse([parts[i] for i in sorted(parts)])
    for mod, bs in biases.items():
        ckpt.floats[mod + ".bias"] = torch.from_numpy(np.concatenate([bs[i] for i in sorted(bs)]))
    ckpt.tied = "lm_head" not in ckpt.linears
    return ckpt


def _fuse(parts: list[tuple[str, np.ndarray, tuple[int, int]]]) -> list[LinearPart]:
    """Neighbouring parts of one kernel format become one packed weight (their rows of
    blocks concatenated): q/k/v of a Q4_0 file give one, those of a Q4_K_M file two
    (q and k in Q4_K, v in Q6_K). Float parts stay fp32 tensors, one each."""
    runs: list[list[tuple[str, np.ndarray, tuple[int, int]]]] = []
    for part in parts:
        if runs and part[0] == runs[-1][0][0] and part[0] != "F32":
            runs[-1].append(part)
        else:
            runs.append([part])
    out: list[LinearPart] = []
    for run in runs:
        qtype, cols = run[0][0], run[0][2][1]
        # copies: the reader's arrays are views of the mapped file
        raw = torch.from_numpy(np.concatenate([r for _, r, _ in run]))
        out.append(raw if qtype == "F32" else quant.pack(qtype, raw, (raw.shape[0], cols)))
    return out


def _layout_tag() -> str:
    """What the cached state depends on besides the file: the kernels' layout, which
    kernels/quant_formats.py defines (one layout for every ISA path), and how this
    module names, fuses and un-permutes."""
    h = hashlib.sha256()
    for f in (quant_formats.__file__, __file__):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def save_cache(ckpt: QuantCheckpoint, out: Path, source: Path) -> None:
    """Write `ckpt` to `out` (a directory, atomically: all of it or nothing)."""
    tensors: dict[str, torch.Tensor] = {f"float.{k}": v.contiguous() for k, v in ckpt.floats.items()}
    index: dict[str, Any] = {
        "version": CACHE_VERSION,
        "layout": _layout_tag(),
        "source": str(source),
        "tied": ckpt.tied,
        "counts": ckpt.counts,
        "linears": {},
    }
    for mod, parts in ckpt.linears.items():
        entries = []
        for i, p in enumerate(parts):
            if isinstance(p, torch.Tensor):
                tensors[f"{mod}.{i}.float"] = p.contiguous()
                entries.append({"qtype": "F32", "shape": list(p.shape)})
                continue
            state = p.state()
            for k, v in state.items():
                tensors[f"{mod}.{i}.{k}"] = v.contiguous()
            entries.append(
                {"qtype": p.qtype, "shape": [p.out_features, p.in_features], "keys": sorted(state)}
            )
        index["linears"][mod] = entries
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        save_file(tensors, str(tmp / "weights.safetensors"))
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("cached the repacked weights in %s", out)


def load_cache(out: Path) -> QuantCheckpoint | None:
    """The checkpoint cached in `out`, or None when there is none for these kernels."""
    try:
        index = json.loads((out / "index.json").read_text())
    except (OSError, ValueError):
        return None
    if index.get("version") != CACHE_VERSION or index.get("layout") != _layout_tag():
        log.info(
            "the cached weights in %s were packed by another version of the kernels or loader: repacking", out
        )
        return None
    try:
        return _read_cache(out, index)
    except (OSError, KeyError, ValueError) as e:  # ValueError: a state of another layout
        log.info("the cached weights in %s cannot be used (%s): repacking", out, e)
        return None


def _read_cache(out: Path, index: dict[str, Any]) -> QuantCheckpoint:
    ckpt = QuantCheckpoint(tied=index["tied"], counts=index["counts"])
    with safe_open(str(out / "weights.safetensors"), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if key.startswith("float."):
                ckpt.floats[key.removeprefix("float.")] = st.get_tensor(key)
        for mod, entries in index["linears"].items():
            parts: list[LinearPart] = []
            for i, e in enumerate(entries):
                if e["qtype"] == "F32":
                    parts.append(st.get_tensor(f"{mod}.{i}.float"))
                    continue
                state = {k: st.get_tensor(f"{mod}.{i}.{k}") for k in e["keys"]}
                parts.append(quant.QuantWeight.from_state(e["qtype"], tuple(e["shape"]), state))
            ckpt.linears[mod] = parts
    return ckpt


def load_gguf_weights(path: Path, cache: Path, cfg: ModelConfig) -> QuantCheckpoint:
    """`path`'s weights, repacked once and cached in `cache`."""
    ckpt = load_cache(cache)
    if ckpt is not None:
        return ckpt
    log.info("repacking %s for the quantized kernels (once; cached in %s)", path.name, cache)
    ckpt = read_gguf(path, cfg)
    if cache.exists():  # a stale layout: replace it
        shutil.rmtree(cache, ignore_errors=True)
    save_cache(ckpt, cache, path)
    return ckpt
