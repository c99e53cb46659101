"""Build the model an engine serves from its config: device, dtype, weights (kept in
their quantized blocks or de-quantized), and the CPU's linear-layer packing.

`--quantization`:
- auto: a GGUF's blocks kept as they are on the CPU (de-quantized to the dtype on
  CUDA); any other checkpoint as it is.
- none: de-quantize at load (the fp32 conversion cached beside the GGUF).
- q8_0 | q4_0: quantize a float checkpoint's linear layers at load.
Without the native kernels (`quant.native_status()`) everything runs de-quantized,
with one warning saying why.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wsllm import kernels
from wsllm.config import QUANTIZE_AT_LOAD, EngineConfig
from wsllm.kernels import quant
from wsllm.models import cpu_linear, loader, registry
from wsllm.models.causal_lm import CausalLM
from wsllm.models.config import ModelConfig
from wsllm.models.gguf_weights import QuantCheckpoint, load_gguf_float, load_gguf_weights
from wsllm.models.quant_linear import install, quantize_model
from wsllm.models.rope import rotary_cache

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # where a CPU computes bf16 matmuls natively


@dataclass(slots=True)
class BuiltModel:
    model: CausalLM
    model_dir: Path  # the HF directory: config, tokenizer (and weights unless quantized)
    name: str  # the name clients know it by, by default
    eos_token_ids: list[int]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_dtype(name: str, device: torch.device, flags: set[str]) -> tuple[torch.dtype, str]:
    """The activations' (and float weights') dtype and why. `auto`: bf16 on CUDA; on a
    CPU, bf16 only where it has AVX512_BF16 or AMX (elsewhere bf16 matmuls are
    emulated and slower than fp32)."""
    if name != "auto":
        return DTYPES[name], "asked for"
    if device.type == "cuda":
        return torch.bfloat16, "auto on CUDA"
    native = sorted(set(BF16_CPU_FLAGS) & flags)
    if native:
        return torch.bfloat16, f"auto: the CPU has {', '.join(native)}, so bf16 matmuls run natively"
    return torch.float32, "auto: the CPU has neither avx512_bf16 nor amx_bf16, so bf16 would be emulated"


def weight_mode(asked: str, gguf: Path | None, device: torch.device, dtype: torch.dtype) -> str:
    """How the weights are held: "gguf" (the file's blocks), "none" (float), or a
    format to quantize a float checkpoint to ("q8_0" | "q4_0")."""
    if asked in QUANTIZE_AT_LOAD and gguf is not None:
        raise ValueError(
            f"--quantization {asked} quantizes a float checkpoint; a GGUF keeps its own formats (auto) or is de-quantized (none)"
        )
    if asked == "none" or (asked == "auto" and gguf is None):
        return "none"
    if device.type != "cpu":
        if asked != "auto":
            raise ValueError(f"--quantization {asked} runs on the CPU only")
        log.info("a quantized GGUF is de-quantized to %s on %s", str(dtype).removeprefix("torch."), device)
        return "none"
    # The native module warns when it cannot build, naming the torch reference as its
    # fallback; the engine falls back further (de-quantized weights) and says so itself,
    # in one line with the reason.
    native_log = logging.getLogger(quant.native.__name__)
    level = native_log.level
    native_log.setLevel(logging.ERROR)
    try:
        ok, why = quant.native_status()
    finally:
        native_log.setLevel(level)
    if not ok:
        log.warning("%s; serving de-quantized weights instead", why)
        return "none"
    return "gguf" if asked == "auto" else asked


def load_gguf_quantized(gguf: Path, model_dir: Path, dtype: torch.dtype) -> tuple[CausalLM, str]:
    """A model over `gguf`'s blocks (repacked once, cached); never holds the
    de-quantized weights. Returns it and the formats kept."""
    cfg = registry.model_config(loader.read_hf_config(model_dir))
    ckpt = load_gguf_weights(gguf, loader.quant_cache_path(gguf), cfg)
    return _installed(cfg, ckpt, dtype), ckpt.describe()


def load_gguf_dequantized(gguf: Path, model_dir: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A float model of `gguf`'s weights, de-quantized from the file (every family's GGUF, with
    the loader's own names and Q/K un-permutation)."""
    cfg = registry.model_config(loader.read_hf_config(model_dir))
    return _installed(cfg, load_gguf_float(gguf, cfg), dtype).to(device)


def _installed(cfg: ModelConfig, ckpt: QuantCheckpoint, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    install(model, ckpt, dtype)
    model.cos_sin_cache = rotary_cache(cfg)  # stays fp32
    return model.eval()


def apply_gil_switch(config: EngineConfig) -> None:
    """The process's GIL switch interval, from `config.gil_switch_ms` (0: Python's own).
    The step thread releases the GIL around every operator and waits to get it back for
    as long as another thread may hold it (docs/benchmarks.md, "Amplification")."""
    if config.gil_switch_ms > 0:
        sys.setswitchinterval(config.gil_switch_ms / 1000)


def build_model(config: EngineConfig) -> BuiltModel:
    """The model `config` names, loaded and ready to run (sets torch's threads, the GIL's
    switch interval and the kernel backend: process-wide, one engine per process)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    apply_gil_switch(config)
    kernels.use_backend(config.attention_backend)
    device = pick_device(config.device)
    dtype, why = pick_dtype(config.dtype, device, cpu_flags() if device.type == "cpu" else set())
    log.info("dtype %s (%s)", str(dtype).removeprefix("torch."), why)
    gguf = loader.gguf_source(config.model)
    mode = weight_mode(config.quantization, gguf, device, dtype)
    t = time.time()
    if mode == "gguf":
        assert gguf is not None
        with loader.shared_gguf_readers():  # a first start reads the file once, not four times
            model_dir = loader.resolve_model_dir(config.model, weights=False)
            model, formats = load_gguf_quantized(gguf, model_dir, dtype)
    elif gguf is not None:
        with loader.shared_gguf_readers():
            model_dir = loader.resolve_model_dir(config.model, weights=False)
            model = load_gguf_dequantized(gguf, model_dir, device, dtype)
    else:
        model_dir = loader.resolve_model_dir(config.model)
        model = loader.load_model(model_dir, device, dtype)
        if mode in QUANTIZE_AT_LOAD:
            counts = quantize_model(model, mode)
            formats = ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
    if mode != "none":
        log.info("weights kept quantized: %s (kernel path %s)", formats, quant.kernel_path())
    if device.type == "cpu" and config.cpu_gemm != "torch":
        packed = cpu_linear.pack_linears(model, batch_hint=min(config.max_num_seqs, 32))
        if not packed and config.cpu_gemm == "onednn" and mode == "none":
            raise RuntimeError(f"cpu_gemm onednn asked for, but oneDNN cannot run {dtype} here")
    if device.type == "cpu":
        # Build (once, cached) or load the native kernels now: the fast row ops use them on
        # every model, and a first build inside a step would stall that step and the
        # engine's heartbeats for as long as the compiler runs.
        quant.native_status()
    loader.release_freed_heap()
    log.info("loaded %s in %.1fs on %s (%s)", model_dir, time.time() - t, device, dtype)
    return BuiltModel(
        model,
        model_dir,
        loader.model_name_for(config.model),
        loader.eos_token_ids(model_dir, loader.read_hf_config(model_dir)),
    )
