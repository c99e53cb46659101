"""LoRA adapters on the served base: load one (a PEFT directory), check that it fits, and
run a step's grouped low-rank pass (`LoraBatch`).

An adapter is PEFT's: `adapter_config.json` and `adapter_model.safetensors`. It may adapt
q, k, v, o, gate, up and down projections of any layers, with PEFT's scaling (`lora_alpha /
r`, or `lora_alpha / sqrt(r)` with `use_rslora`). Everything else PEFT can save is refused
at load with a message that names it: DoRA, LoRA biases, `modules_to_save`, patterns of
ranks or alphas, other target modules (embeddings, the LM head, a mixture's experts or router: LoRA
runs on the attention projections and dense MLPs), a rank over
`--max-lora-rank`, weights whose shapes do not fit the base, a missing file.

The pieces are float32, or bfloat16 under a bfloat16 model (`kernels/lora.py`): A as it is, B
transposed with the scaling folded in (in float32, then rounded), each with its place in the fused projection the
base runs (q, k, v side by side in qkv; gate, up in gate_up). The base projection runs once
for the whole batch; `LoraBatch.apply` adds each adapter's delta to its rows only."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from wsllm import kernels
from wsllm.kernels import lora as klora
from wsllm.kernels.lora import SLOTS, LoraPiece, NativeLora
from wsllm.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the modules an adapter may target -> (its projection in SLOTS, its part of it)
MODULES = {
    "q_proj": (0, 0),
    "k_proj": (0, 1),
    "v_proj": (0, 2),
    "o_proj": (1, 0),
    "gate_proj": (2, 0),
    "up_proj": (2, 1),
    "down_proj": (3, 0),
}
# PEFT options that change the arithmetic beyond plain LoRA: refused unless unset (None,
# false, empty) or at the value named here
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
}
_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
#: a weight of a mixture's experts, router or shared expert (refused: LoRA runs on attention and dense MLPs)
_EXPERTS = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts|gate|router|shared_expert\w*|input_linear|output_linear)\."
)
#: an adapter's name: it travels on the wire and names a Redis waiting set
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")


class AdapterError(ValueError):
    """An adapter that cannot be served on this base: the message says why."""


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    scaling: float  # lora_alpha / r (or / sqrt(r): rsLoRA), folded into the pieces' B
    modules: list[str]  # the module names it adapts, sorted
    digest: str  # sha256 of its files: its KV is its own (prefix-cache namespace)
    nbytes: int  # its pieces' bytes
    pieces: dict[tuple[int, int], list[LoraPiece]] = field(repr=False)  # (layer, slot) -> pieces
    native: NativeLora | None = field(default=None, repr=False)  # made on first native use

    def slot(self, layer: int, slot: int) -> list[LoraPiece]:
        return self.pieces.get((layer, slot), [])

    def native_handle(self, ext: Any) -> Any:
        if self.native is None:
            self.native = NativeLora(ext, self.pieces)
        return self.native.handle


def _out_sizes(c: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """module -> (in features, out features, first column in its fused projection)."""
    q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {
        "q_proj": (h, q, 0),
        "k_proj": (h, kv, q),
        "v_proj": (h, kv, q + kv),
        "o_proj": (q, h, 0),
        "gate_proj": (h, i, 0),
        "up_proj": (h, i, i),
        "down_proj": (i, h, 0),
    }


def read_config(path: Path) -> dict[str, Any]:
    """The adapter's config, checked: PEFT's LoRA with nothing this server does not run."""
    if not path.is_dir():
        raise AdapterError(f"no adapter directory at {path}")
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / fname).is_file():
            raise AdapterError(
                f"{path} has no {fname} (a PEFT adapter directory has {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    _refuse_experts(path)
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} is not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(f"{path}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise AdapterError(
                f"{path}: unknown target modules {unknown}; an adapter may target {sorted(MODULES)}"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{path}: r must be a positive integer and lora_alpha a number")
    return cfg


def _refuse_experts(path: Path) -> None:
    """AdapterError when the adapter adapts a mixture's experts or router (before its options: PEFT
    writes a rank_pattern for such targets, which would be refused with a less useful reason)."""
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if _EXPERTS.search(key):
                raise AdapterError(
                    f"{path}: weight {key!r} adapts a mixture's experts (or its router), which LoRA here does "
                    "not run: an adapter may target the attention projections, and the MLP of a dense layer"
                )


def _read_weights(
    path: Path, c: ModelConfig, max_rank: int
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": [r, in], "B": [out, r]}, every name and shape checked."""
    sizes = _out_sizes(c)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as st:
        for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
            m = _WEIGHT.search(key)
            if m is None or m.group(2) not in MODULES:
                raise AdapterError(
                    f"{path}: weight {key!r} is not a LoRA weight of a module this server adapts ({sorted(MODULES)})"
                )
            layer, module, which = int(m.group(1)), m.group(2), m.group(3)
            if layer >= c.num_layers:
                raise AdapterError(
                    f"{path}: {key!r} is for layer {layer}; the base has {c.num_layers} layers"
                )
            if MODULES[module][0] >= 2 and c.layer(layer).moe:
                raise AdapterError(
                    f"{path}: {key!r} adapts layer {layer}'s MLP, but its feed-forward is a mixture of experts, "
                    "which LoRA here does not run"
                )
            found.setdefault((layer, module), {})[which] = st.get_tensor(key)
    if not found:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), ab in found.items():
        a, b = ab.get("A"), ab.get("B")
        where = f"{path}: layers.{layer}.{module}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_{'A' if a is None else 'B'} missing")
        fan_in, fan_out, _ = sizes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not pair")
        if a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise AdapterError(
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base "
                f"({module} is {fan_in} -> {fan_out}): an adapter of another model"
            )
        if a.shape[0] > max_rank:
            raise AdapterError(f"{where}: rank {a.shape[0]} is over --max-lora-rank {max_rank}")
    return found


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        with open(path / fname, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_adapter(
    name: str,
    path: str | Path,
    c: ModelConfig,
    max_rank: int,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """The adapter in `path` as `name`, on a base of config `c`, its pieces in `dtype` (float32,
    or bfloat16 under a bfloat16 model: half the bytes a step reads); AdapterError when it does
    not fit."""
    if not NAME.fullmatch(name):
        raise AdapterError(f"adapter name {name!r}: letters, digits and _.:/- only, 128 at most")
    p = Path(path).expanduser()
    cfg = read_config(p)
    weights = _read_weights(p, c, min(max_rank, klora.MAX_NATIVE_RANK))
    sizes = _out_sizes(c)
    pieces: dict[tuple[int, int], list[LoraPiece]] = {}
    rank, scalings = 0, set()
    alpha = float(cfg.get("lora_alpha", 8))
    for (layer, module), ab in sorted(weights.items(), key=lambda kv: (kv[0][0], MODULES[kv[0][1]])):
        r = int(ab["A"].shape[0])
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        scalings.add(scaling)
        a = ab["A"].detach().to(device=device, dtype=dtype).contiguous()
        bt = (ab["B"].detach().to(device=device, dtype=torch.float32) * scaling).t().to(dtype).contiguous()
        pieces.setdefault((layer, MODULES[module][0]), []).append(LoraPiece(a, bt, sizes[module][2]))
        rank = max(rank, r)
    nbytes = _pack(pieces)
    return LoraAdapter(
        name,
        str(p),
        rank,
        scalings.pop() if len(scalings) == 1 else float("nan"),
        sorted({m for _, m in weights}),
        _digest(p),
        nbytes,
        pieces,
    )


def _pack(pieces: dict[tuple[int, int], list[LoraPiece]]) -> int:
    """Put every piece into one buffer, in the order a step reads them (layer by layer, each
    projection's pieces, A then B): a decode step of one row then reads the adapter as one
    stream, which the CPU's prefetchers follow, instead of a few hundred small arrays. Returns
    the buffer's bytes."""
    order = [p for key in sorted(pieces) for p in pieces[key]]
    first = order[0].a
    flat = torch.empty(sum(p.a.numel() + p.bt.numel() for p in order), dtype=first.dtype, device=first.device)
    at = 0
    for p in order:
        for name in ("a", "bt"):
            t = getattr(p, name)
            view = flat[at : at + t.numel()].view(t.shape)
            view.copy_(t)
            setattr(p, name, view)
            at += t.numel()
    return flat.nbytes


class LoraBatch:
    """The adapters of one step and their rows: what every adapted projection of every
    layer adds to the base's output. Built by the model runner, passed in the attention
    metadata; None there when no row of the step uses an adapter."""

    def __init__(self, adapters: list[LoraAdapter], rows: list[torch.Tensor | None]) -> None:
        self.adapters = adapters  # each used by some row of the step, once
        self.rows = rows  # per adapter: its rows of the packed batch, int64 (None: every row)
        self._handles: list[Any] | None = None

    @classmethod
    def build(
        cls, per_seq: list[LoraAdapter | None], q_lens: list[int], device: torch.device
    ) -> LoraBatch | None:
        """The step's groups from each scheduled sequence's adapter and its row count (a
        verifying sequence's draft rows run under its adapter like its other rows)."""
        if not any(per_seq):
            return None
        if all(a is per_seq[0] for a in per_seq):
            return cls([per_seq[0]], [None])  # type: ignore[list-item]
        rows: dict[int, list[int]] = {}
        by_id: dict[int, LoraAdapter] = {}
        start = 0
        for a, n in zip(per_seq, q_lens, strict=True):
            if a is not None:
                by_id[id(a)] = a
                rows.setdefault(id(a), []).extend(range(start, start + n))
            start += n
        return cls(
            [by_id[k] for k in rows],
            [torch.tensor(r, dtype=torch.long, device=device) for r in rows.values()],
        )

    def apply(self, layer: int, slot: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [M, N] (the projection `slot` of `layer` over x [M, K]) += each adapter's delta on its rows.
        The kernel backend picks the version as for every op (`kernels.use_backend`)."""
        backend = kernels.backend()
        if (
            backend == "auto"
            and klora.native_lora_ok(x, y)
            and (handles := self.native_handles()) is not None
        ):
            klora.lora_apply_cpu(y, x, layer * len(SLOTS) + slot, handles, self.rows)
            return
        groups = [(a.slot(layer, slot), r) for a, r in zip(self.adapters, self.rows, strict=True)]
        if backend == "triton" or (backend == "auto" and y.device.type == "cuda"):
            klora.lora_apply_triton(y, x, groups)
        else:
            klora.lora_apply_ref(y, x, groups)

    def native_rows(self) -> list[torch.Tensor]:
        """The rows as the native kernels take them (an empty tensor: every row)."""
        return [klora.EMPTY_ROWS if r is None else r for r in self.rows]

    def native_handles(self) -> list[Any] | None:
        """The adapters' native weights (None without the native build): the decode stack's too."""
        if self._handles is None:
            from wsllm.kernels import cpu_ops

            ext = cpu_ops.native_ext()
            if ext is None or not hasattr(ext, "lora_apply"):
                return None
            self._handles = [a.native_handle(ext) for a in self.adapters]
        return self._handles
