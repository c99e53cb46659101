"""The GGUF repack (wsllm/models/gguf_weights.py) streams: a long tensor is packed in
chunks of rows, fused parts (q/k/v, gate/up) are joined chunk by chunk, and what it
caches is the same whatever the chunk; the cache is read as a map of its file, not a
copy onto the heap. A file whose tensors disagree with its config (a short embedding
table, a missing or truncated tensor) does not load, and the error names the file and
the tensor (gguf_checks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from wsllm.kernels import quant_formats

from wsllm.models import gguf_weights
from wsllm.models.config import ModelConfig
from wsllm.models.gguf_checks import GGUFError, check_tensors, expected_shape, required
from wsllm.models.loader import convert_gguf, read_hf_config, shared_gguf_readers
from wsllm.models.registry import model_config


def test_a_repack_in_chunks_of_rows_caches_what_one_in_whole_tensors_does(
    tiny_gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with shared_gguf_readers():  # the file's metadata parsed once for the three
        cfg = model_config(read_hf_config(convert_gguf(tiny_gguf_path, weights=False)))
        monkeypatch.setattr(gguf_weights, "_CHUNK_ROWS", 1 << 30)  # every tensor in one piece
        gguf_weights.repack(tiny_gguf_path, tmp_path / "whole", cfg)
        monkeypatch.setattr(gguf_weights, "_CHUNK_ROWS", quant_formats.ROWS)  # one group of rows at a time
        gguf_weights.repack(tiny_gguf_path, tmp_path / "chunks", cfg)
    whole, chunks = gguf_weights.load_cache(tmp_path / "whole"), gguf_weights.load_cache(tmp_path / "chunks")
    assert whole is not None and chunks is not None
    assert whole.linears.keys() == chunks.linears.keys() and whole.counts == chunks.counts
    fused = [m for m, parts in whole.linears.items() if "gate_up" in m and len(parts) == 1]
    assert fused, "the tiny GGUF fuses gate/up (and q/k): the chunks cross the parts' boundaries"
    for mod, parts in whole.linears.items():
        for a, b in zip(parts, chunks.linears[mod], strict=True):
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and torch.equal(a, b)
            else:
                assert not isinstance(b, torch.Tensor)
                assert (a.qtype, a.out_features, a.in_features) == (b.qtype, b.out_features, b.in_features)
                assert torch.equal(a.packed, b.packed), mod
    for name, v in whole.floats.items():
        assert torch.equal(v, chunks.floats[name])


def _mapped_from(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def test_the_cached_weights_are_a_map_of_the_file_not_a_copy(tiny_gguf_path: Path, tmp_path: Path) -> None:
    """Resident only as read, like llama.cpp's mmap: an 8B model's 5 GB are not copied onto
    the heap at start."""
    cfg = model_config(read_hf_config(convert_gguf(tiny_gguf_path, weights=False)))
    ckpt = gguf_weights.load_gguf_weights(tiny_gguf_path, tmp_path / "cache", cfg)
    ranges = _mapped_from((tmp_path / "cache" / "weights.bin").resolve())
    weights = [p.packed for parts in ckpt.linears.values() for p in parts if not isinstance(p, torch.Tensor)]
    assert ranges and weights
    for w in weights:
        assert any(lo <= w.data_ptr() < hi for lo, hi in ranges)


def _refused(tmp_path: Path, like: Any, cfg: ModelConfig, name: str, change: Any) -> GGUFError:
    """Write the tiny GGUF with `change`, load it for `cfg`, and return the error it raises."""
    path = like(tmp_path / f"{name}.Q4_0.gguf", change)
    with pytest.raises(GGUFError) as e:
        gguf_weights.load_gguf_weights(path, tmp_path / f"{name}-cache", cfg)
    assert str(path) in str(e.value)
    return e.value


def test_a_gguf_whose_tensors_disagree_with_its_config_does_not_load(
    tiny_gguf_source: Path, tiny_gguf_like: Any, tiny_gguf_path: Path, tmp_path: Path
) -> None:
    """An embedding table 32 rows short of the vocabulary loaded, and a token id in the
    gap then failed a whole engine step; now the file is refused, naming the tensor."""
    cfg = model_config(read_hf_config(tiny_gguf_source))  # what the file's metadata says
    v = cfg.vocab_size
    short = _refused(
        tmp_path, tiny_gguf_like, cfg, "short", lambda n, x: x[:-32] if n == "token_embd.weight" else x
    )
    assert short.tensor == "token_embd.weight" and f"[{v - 32}, " in str(short) and f"[{v}, " in str(short)
    # a truncated file: its last tensor is short ("cannot reshape array of size 2040 ..." named nothing)
    cut = tmp_path / "cut.Q4_0.gguf"
    cut.write_bytes(tiny_gguf_path.read_bytes()[:-5000])
    with pytest.raises(GGUFError) as e:
        gguf_weights.load_gguf_weights(cut, tmp_path / "cut-cache", cfg)
    assert (
        str(cut) in str(e.value)
        and e.value.tensor.startswith(("blk.", "output"))
        and "truncated" in str(e.value)
    )
    # what a well-formed file of this config holds, and three ways to break it
    tensors = [(n, expected_shape(n, cfg) or (1,), 64, 64) for n in required(cfg)]
    check_tensors("tiny.gguf", tensors, cfg)
    for broken, names in (
        ([t for t in tensors if t[0] != "blk.1.ffn_up.weight"], ("blk.1.ffn_up.weight", "missing")),
        (
            [t if t[0] != "output_norm.weight" else (*t[:2], 0, t[3]) for t in tensors],
            ("output_norm.weight", "truncated"),
        ),
        ([*tensors, ("blk.99.attn_q.weight", (64, 64), 1, 1)], ("blk.99.attn_q.weight", "layer 99")),
    ):
        with pytest.raises(GGUFError) as e:
            check_tensors("tiny.gguf", broken, cfg)
        assert e.value.tensor == names[0] and names[1] in str(e.value) and "tiny.gguf" in str(e.value)
