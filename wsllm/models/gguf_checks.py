"""A GGUF file's tensors checked against the model's config before any weight is read
(`check_tensors`), and the one error every GGUF load failure is (`GGUFError`: it names
the file and the tensor), and `open_reader`, which finds a truncated file's first short
tensor before gguf's reader fails on it.

Without the check a file whose shapes disagree with its own metadata loads: an
embedding table smaller than the vocabulary is a gap of token ids that a request can
name, and one such id fails a whole engine step (every request in it); a truncated file
fails deep in a reshape ("cannot reshape array of size 0 into shape (32,68)") that names
neither the file nor the tensor. Every tensor the model reads must be there, of the
shape its config says, in a layer the config has."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from wsllm.models.config import ModelConfig


class GGUFError(ValueError):
    """A GGUF the model cannot load; the message names the file and the tensor."""

    def __init__(self, path: str | Path, tensor: str, problem: str) -> None:
        super().__init__(f"{path}: tensor {tensor}: {problem}")
        self.path, self.tensor = str(path), tensor


_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
_DENSE = ("ffn_gate", "ffn_up", "ffn_down")
_SANDWICH = ("post_attention_norm", "post_ffw_norm")  # Gemma's (ModelConfig.sandwich_norms)


def _fused(names: set[str] | None, blk: str) -> tuple[bool, bool]:
    """Whether layer `blk`'s file keeps q|k|v in one attn_qkv, and gate|up in one ffn_up (Phi-3)."""
    if names is None:
        return False, False
    return f"{blk}attn_qkv.weight" in names, f"{blk}ffn_gate.weight" not in names


def _layer_shapes(cfg: ModelConfig, layer: int, names: set[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s tensors' shapes in row order ([out_features, in_features] for a weight;
    [experts, out, in] for the experts' projections); `names`, the file's, says which are fused."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "post_attention_norm.weight": (h,),
        "post_ffw_norm.weight": (h,),
        "attn_qkv.weight": (q + 2 * kv, h),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_q_norm.weight": (q,) if cfg.qk_norm == "full" else (cfg.head_dim,),
        "attn_k_norm.weight": (kv,) if cfg.qk_norm == "full" else (cfg.head_dim,),
        "attn_output.bias": (h,),
        "attn_sinks.weight": (cfg.num_heads,),
    }
    m = cfg.moe
    if m is None or not cfg.layer(layer).moe:
        ff = cfg.intermediate_size
        up = 2 * ff if _fused(names, f"blk.{layer}.")[1] else ff
        return shapes | {"ffn_gate.weight": (ff, h), "ffn_up.weight": (up, h), "ffn_down.weight": (h, ff)}
    e, i, s = m.num_experts, m.intermediate_size, m.shared_intermediate_size
    shapes |= {
        "ffn_gate_inp.weight": (e, h),
        "exp_probs_b.bias": (e,),
        "ffn_gate_exps.weight": (e, i, h),
        "ffn_up_exps.weight": (e, i, h),
        "ffn_gate_up_exps.weight": (e, 2 * i, h),
        "ffn_down_exps.weight": (e, h, i),
        "ffn_gate_inp.bias": (e,),
        "ffn_gate_exps.bias": (e, i),
        "ffn_up_exps.bias": (e, i),
        "ffn_down_exps.bias": (e, h),
    }
    if s:
        shapes |= {
            "ffn_gate_shexp.weight": (s, h),
            "ffn_up_shexp.weight": (s, h),
            "ffn_down_shexp.weight": (h, s),
        }
        shapes |= {"ffn_gate_inp_shexp.weight": (h,)} if m.shared_gate else {}
    return shapes


def expected_shape(name: str, cfg: ModelConfig, names: set[str] | None = None) -> tuple[int, ...] | None:
    """The shape (row order) the config gives tensor `name` (`names`: the file's, for what it
    fuses); None for a tensor the model does not read as a weight (rope_freqs, Phi-3's rope
    factors, read into the config). KeyError for a name it does not know."""
    h, v = cfg.hidden_size, cfg.vocab_size
    glob = {"token_embd.weight": (v, h), "output.weight": (v, h), "output_norm.weight": (h,)}
    if name in glob:
        return glob[name]
    if name.startswith(("rope_freqs", "rope_factors_long", "rope_factors_short")):
        return None
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) < 3 or not parts[1].isdigit():
        raise KeyError("not a tensor of this model")
    if int(parts[1]) >= cfg.num_layers:
        raise KeyError(f"layer {parts[1]} of a model of {cfg.num_layers} layers")
    shape = _layer_shapes(cfg, int(parts[1]), names).get(parts[2])
    if shape is None:
        raise KeyError("not a tensor of this model")
    return shape


def required(cfg: ModelConfig, names: set[str] | None = None) -> list[str]:
    """The tensors a model of `cfg` cannot do without (`output` may be tied to `token_embd`;
    an MoE layer's gate and up experts come apart or fused: `names`, the file's, says which)."""
    out = ["token_embd.weight", "output_norm.weight"]
    extra = [f"{p}.bias" for p in ("attn_q", "attn_k", "attn_v")] if cfg.qkv_bias else []
    extra += ["attn_q_norm.weight", "attn_k_norm.weight"] if cfg.qk_norm != "none" else []
    extra += ["attn_output.bias"] if cfg.o_bias else []
    extra += ["attn_sinks.weight"] if cfg.attn_sinks else []
    m = cfg.moe
    for i in range(cfg.num_layers):
        blk = f"blk.{i}."
        qkv, gate_up = _fused(names, blk)
        # gpt-oss's norm before the feed-forward is its post_attention_norm (Gemma's is a sandwich norm)
        post = not cfg.sandwich_norms and names is not None and f"{blk}post_attention_norm.weight" in names
        attention = [
            t
            for t in _ATTENTION
            if not (qkv and t in ("attn_q", "attn_k", "attn_v")) and not (post and t == "ffn_norm")
        ]
        attention += (["attn_qkv"] if qkv else []) + (["post_attention_norm"] if post else [])
        out += [f"{blk}{t}.weight" for t in attention]
        out += [blk + t for t in extra if not qkv or not t.startswith(("attn_q.", "attn_k.", "attn_v."))]
        out += [f"{blk}{t}.weight" for t in _SANDWICH] if cfg.sandwich_norms else []
        if m is None or not cfg.layer(i).moe:
            out += [f"{blk}{t}.weight" for t in _DENSE if not (gate_up and t == "ffn_gate")]
            continue
        fused = names is not None and f"{blk}ffn_gate_up_exps.weight" in names
        experts = ["ffn_gate_up_exps"] if fused else ["ffn_gate_exps", "ffn_up_exps"]
        out += [f"{blk}{t}.weight" for t in ["ffn_gate_inp", *experts, "ffn_down_exps"]]
        out += [f"{blk}exp_probs_b.bias"] if m.selection_bias else []
        out += [f"{blk}ffn_gate_inp.bias"] if m.router_bias else []
        out += [f"{blk}{t}.bias" for t in [*experts, "ffn_down_exps"]] if m.expert_bias else []
        if m.shared_intermediate_size:
            out += [f"{blk}{t}.weight" for t in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
            out += [f"{blk}ffn_gate_inp_shexp.weight"] if m.shared_gate else []
    return out


def check_tensors(
    path: str | Path, tensors: Iterable[tuple[str, tuple[int, ...], int, int]], cfg: ModelConfig
) -> None:
    """Each (name, shape in row order, bytes in the file, bytes its shape needs) against
    `cfg`; GGUFError naming the file and the first tensor that is unknown, of another
    shape, shorter than its shape needs (a truncated file), or missing."""
    listed = list(tensors)
    names = {t[0] for t in listed}
    seen = set()
    for name, shape, have, need in listed:
        try:
            want = expected_shape(name, cfg, names)
        except KeyError as e:
            raise GGUFError(path, name, str(e).strip("'\"")) from None
        if want is not None and tuple(shape) != want:
            m, what = cfg.moe, ""
            if m is not None and "_exps." in name:
                what = (
                    f" ({m.num_experts} experts, each {m.intermediate_size} wide, by the file's own counts)"
                )
            raise GGUFError(
                path, name, f"shape {list(shape)}, but the model's config says {list(want)}{what}"
            )
        if have < need:
            raise GGUFError(
                path, name, f"{have} bytes of the {need} its shape {list(shape)} needs (a truncated file?)"
            )
        seen.add(name)
    missing = [n for n in required(cfg, seen) if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(path, missing[0], f"missing from the file{more}")


def open_reader(path: str | Path) -> Any:
    """A gguf.GGUFReader of `path`. A tensor whose data lies past the file's end (a
    truncated file) is a GGUFError naming it: gguf's own reader fails on a reshape that
    names neither the file nor the tensor ("cannot reshape array of size 0 ...")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.gguf_reader import GGUFReader  # the class (loader.shared_gguf_readers swaps the package's)

    class _Reader(GGUFReader):  # type: ignore[misc]
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _, raw_name, _, dims, raw_type, offset = field.parts
                name = bytes(raw_name).decode("utf-8", "replace")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    raise GGUFError(
                        path, name, f"a tensor type this loader does not know ({int(raw_type[0])})"
                    ) from None
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise GGUFError(
                        path, name, f"its data ends at byte {end}, past the file's {size} (a truncated file?)"
                    )
            super()._build_tensors(start_offs, fields)

    import gguf

    if gguf.GGUFReader is not GGUFReader:  # loader.shared_gguf_readers: its one parse, if it reads
        with contextlib.suppress(Exception):
            return gguf.GGUFReader(str(path))
    try:
        return _Reader(str(path))
    except (GGUFError, OSError):
        raise
    except Exception as e:  # its header or metadata: no tensor of it is known yet
        raise GGUFError(path, "(the header)", str(e)) from e
