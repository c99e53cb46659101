"""A GGUF file's weights in their quantized blocks, under the model's own names (gguf_plan.py maps
the names and reads what is small); q/k/v and gate/up are fused into one weight where the parts
share a format (a Q4_K_M file mixes Q4_K and Q6_K inside attention: those stay apart); each
experts module's gate, up and down are one weight each over every expert's rows.

The repacked weights are cached once beside the converted HF directory: one flat file of
tensors (`weights.bin`, each 64-byte aligned) and `index.json` saying where each lies.
The repack streams: one module at a time (a long tensor in chunks of rows) from the GGUF's
memory map to the file, so that an 8B model is repacked in a few hundred MB, never held
whole. Loading maps the file: the weights are resident as the OS pages them in (as
llama.cpp's mmap), not copied onto the heap: each expert is in memory once. Shapes are checked
against the config first (`gguf_checks.py`); every failure is a GGUFError naming the file and
the tensor. `load_gguf_float` reads the same plan de-quantized (the float model: `--quantization
none`, CUDA), uncached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from wsllm.kernels import quant, quant_formats
from wsllm.models import gguf_checks, gguf_plan, rope
from wsllm.models.config import ModelConfig
from wsllm.models.gguf_checks import GGUFError, open_reader
from wsllm.models.gguf_plan import Source

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: weights.bin + offsets in index.json (1: one safetensors file)
_ALIGN = 64  # each tensor's offset in weights.bin: any dtype's view, and cache lines
_CHUNK_ROWS = 256 * quant_formats.ROWS  # rows packed at a time (whole groups of ROWS)
# One linear's weight: blocks kept as they are, or an fp32 [rows, in_features] tensor.
LinearPart = quant.QuantWeight | torch.Tensor


@dataclass(slots=True)
class ExpertParts:
    """An experts module's projections: gate and up [E * I, H], down [E * H, I], each kept in its
    blocks or fp32."""

    num_experts: int
    gate: LinearPart
    up: LinearPart
    down: LinearPart


@dataclass(slots=True)
class QuantCheckpoint:
    """A model's weights with its linear layers (and embedding) kept quantized."""

    # module name ("layers.0.self_attn.qkv_proj", "embed_tokens", "lm_head") -> its
    # weight in row order: one part when fused or single, else one per projection
    linears: dict[str, list[LinearPart]] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> fp32 (norms, biases)
    experts: dict[str, ExpertParts] = field(default_factory=dict)  # "layers.N.mlp.experts" -> its projections
    tied: bool = False  # lm_head is embed_tokens' weight (one copy)
    counts: dict[str, int] = field(default_factory=dict)  # GGUF tensors kept quantized, per format

    def describe(self) -> str:
        return ", ".join(f"{k} x {v}" for k, v in sorted(self.counts.items())) or "none"


def _runs(parts: list[Source]) -> list[list[Source]]:
    """Neighbouring parts of one kernel format become one packed weight (their rows of
    blocks concatenated): q/k/v of a Q4_0 file give one, those of a Q4_K_M file two
    (q and k in Q4_K, v in Q6_K). Float parts stay fp32 tensors, one each."""
    runs: list[list[Source]] = []
    for part in parts:
        if runs and part.qtype == runs[-1][0].qtype and part.qtype != "F32":
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _row_chunks(parts: list[np.ndarray], chunk: int) -> Iterator[np.ndarray]:
    """The rows of `parts` stacked, `chunk` rows at a time (the last may be shorter)."""
    pending: list[np.ndarray] = []
    have = 0
    for p in parts:
        start = 0
        while start < len(p):
            take = min(chunk - have, len(p) - start)
            pending.append(p[start : start + take])
            have, start = have + take, start + take
            if have == chunk:
                yield np.concatenate(pending)
                pending, have = [], 0
    if pending:
        yield np.concatenate(pending)


class _Blob:
    """weights.bin being written: tensors one after another, each at an aligned offset."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.pos = f, 0

    def begin(self) -> int:
        """Align for the next tensor; its offset."""
        pad = -self.pos % _ALIGN
        self.f.write(b"\0" * pad)
        self.pos += pad
        return self.pos

    def write(self, a: np.ndarray | torch.Tensor) -> None:
        """Append `a`'s bytes (a tensor written in pieces: call once per piece)."""
        arr = np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a)
        self.f.write(memoryview(arr).cast("B"))
        self.pos += arr.nbytes


def _write_run(blob: _Blob, run: list[Source]) -> dict[str, Any]:
    """One linear part into `blob`, packed chunk by chunk; its index entry."""
    qtype, cols = run[0].qtype, run[0].shape[1]
    offset = blob.begin()
    if qtype == "F32":
        rows = run[0].rows()
        blob.write(rows.astype(np.float32, copy=False))
        return {"qtype": "F32", "shape": list(rows.shape), "offset": offset}
    n, layout = 0, None
    for chunk in _row_chunks([s.rows() for s in run], _CHUNK_ROWS):
        w = quant.pack(qtype, chunk, (len(chunk), cols))
        blob.write(w.packed)
        n += len(chunk)
        layout = w.state()["layout"].tolist()
    return {"qtype": qtype, "shape": [n, cols], "offset": offset, "layout": layout}


def _read_run(path: Path, blob: _Blob, run: list[Source]) -> dict[str, Any]:
    """`_write_run`, a failure (a truncated file's short tensor) a GGUFError naming it."""
    try:
        return _write_run(blob, run)
    except Exception as e:
        raise GGUFError(path, " + ".join(s.name for s in run), str(e)) from e


def _drop_pages(reader: Any) -> None:
    """Let go of the GGUF pages read so far: they stay in the page cache, but no longer
    count as this process's resident memory (the repack would otherwise grow to the
    file's size)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        reader.data._mmap.madvise(mmap.MADV_DONTNEED)


def repack(path: Path, out: Path, cfg: ModelConfig) -> None:
    """Repack `path`'s weights into the cache directory `out` (atomically: all of it or
    nothing), one module at a time: linear weights of the kernels' formats in the
    kernels' layout, the rest fp32, Q/K rows un-permuted for a llama-architecture file."""
    from tqdm import tqdm

    reader = open_reader(path)
    plan = gguf_plan.plan(path, reader, cfg)
    index: dict[str, Any] = {"version": CACHE_VERSION, "layout": _layout_tag(), "source": str(path),
                             "tied": "lm_head" not in plan.linears, "counts": plan.counts,
                             "floats": {}, "linears": {}, "experts": {}}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        with open(tmp / "weights.bin", "wb") as f:
            blob = _Blob(f)
            for name, v in plan.floats.items():
                index["floats"][name] = {"shape": list(v.shape), "offset": blob.begin()}
                blob.write(v.float().contiguous())
            for mod, parts in tqdm(plan.linears.items(), desc=f"repacking {path.name}", unit="module"):
                runs = _runs([parts[i] for i in sorted(parts)])
                index["linears"][mod] = [_read_run(path, blob, run) for run in runs]
                _drop_pages(reader)
            for mod, ex in tqdm(plan.experts.items(), desc=f"repacking {path.name}'s experts", unit="layer"):
                entry: dict[str, Any] = {"num_experts": plan.num_experts[mod]}
                for which in ("gate", "up", "down"):
                    entry[which] = _read_run(path, blob, [ex[which]])
                    _drop_pages(reader)
                index["experts"][mod] = entry
        (tmp / "index.json").write_text(json.dumps(index, indent=1))
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("cached the repacked weights in %s", out)


def _layout_tag() -> str:
    """What the cached state depends on besides the file: the kernels' layout, which
    kernels/quant_formats.py defines (one layout for every ISA path), and how this
    module names, fuses, un-permutes and reorders rows (partial rotary: rope.py)."""
    h = hashlib.sha256()
    for f in (quant_formats.__file__, __file__, gguf_checks.__file__, gguf_plan.__file__, rope.__file__):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


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
    except (OSError, KeyError, ValueError, RuntimeError) as e:  # ValueError: a state of another layout
        log.info("the cached weights in %s cannot be used (%s): repacking", out, e)
        return None


def _read_cache(out: Path, index: dict[str, Any]) -> QuantCheckpoint:
    """Views of weights.bin, mapped (copy-on-write, never written): paged in as read."""
    path = out / "weights.bin"
    blob = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)

    def view(offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if offset + n > blob.numel():
            raise ValueError(f"{path} is shorter than its index says")
        return blob[offset : offset + n].view(dtype).view(shape)

    def part(e: dict[str, Any]) -> LinearPart:
        if e["qtype"] == "F32":
            return view(e["offset"], e["shape"], torch.float32)
        n, k = e["shape"]
        bs = quant_formats.BLOCK[e["qtype"]][0]
        groups = -(-n // quant_formats.ROWS)
        packed = view(
            e["offset"], [groups, k // bs, quant_formats.packed_block_bytes(e["qtype"])], torch.uint8
        )
        state = {"packed": packed, "layout": torch.tensor(e["layout"], dtype=torch.int32)}
        return quant.QuantWeight.from_state(e["qtype"], (n, k), state)

    ckpt = QuantCheckpoint(tied=index["tied"], counts=index["counts"])
    for name, e in index["floats"].items():
        ckpt.floats[name] = view(e["offset"], e["shape"], torch.float32)
    for mod, entries in index["linears"].items():
        ckpt.linears[mod] = [part(e) for e in entries]
    for mod, e in index.get("experts", {}).items():
        ckpt.experts[mod] = ExpertParts(e["num_experts"], part(e["gate"]), part(e["up"]), part(e["down"]))
    return ckpt


def load_gguf_weights(path: Path, cache: Path, cfg: ModelConfig) -> QuantCheckpoint:
    """`path`'s weights, repacked once and cached in `cache`."""
    ckpt = load_cache(cache)
    if ckpt is not None:
        return ckpt
    log.info("repacking %s for the quantized kernels (once; cached in %s)", path.name, cache)
    if cache.exists():  # a stale layout: replace it
        shutil.rmtree(cache, ignore_errors=True)
    repack(path, cache, cfg)
    ckpt = load_cache(cache)
    if ckpt is None:
        raise RuntimeError(f"the weights repacked into {cache} cannot be read back")
    return ckpt


def load_gguf_float(path: Path, cfg: ModelConfig) -> QuantCheckpoint:
    """`path`'s weights de-quantized to fp32 (Q/K rows un-permuted), read from the file itself, not
    cached: the float model's (`--quantization none`, CUDA, no native build)."""
    reader = open_reader(path)
    plan = gguf_plan.plan(path, reader, cfg, dequantize=True)
    ckpt = QuantCheckpoint(tied="lm_head" not in plan.linears, floats=plan.floats)

    def rows(sources: list[Source]) -> torch.Tensor:
        try:
            return torch.from_numpy(
                np.concatenate([s.rows() for s in sources]).astype(np.float32, copy=False)
            )
        except Exception as e:
            raise GGUFError(path, " + ".join(s.name for s in sources), str(e)) from e

    for mod, parts in plan.linears.items():
        ckpt.linears[mod] = [rows([parts[i] for i in sorted(parts)])]
    for mod, ex in plan.experts.items():
        ckpt.experts[mod] = ExpertParts(
            plan.num_experts[mod], *(rows([ex[w]]) for w in ("gate", "up", "down"))
        )
    return ckpt
