"""One dataclass per component. Each field is declared once; the CLI flag
(`--kv-cache-gb`) and the environment variable (`WSLLM_KV_CACHE_GB`) are derived
from it (`add_arguments`, `from_args`, here). Precedence: CLI flag > environment >
default.

The engine's settings (`EngineConfig`) are here; the others each in a module of their
own: `config_gateway.GatewayConfig`, `config_redis.RedisConfig` (the broker), and
`config_process.ModelRefConfig` / `LogConfig` (what a command serves, how it logs)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


# Formats a float checkpoint can be quantized to at load (--quantization).
QUANTIZE_AT_LOAD = ("q8_0", "q4_0")


@dataclass(slots=True)
class EngineConfig:
    # Set from ModelRefConfig's --model by `serve` and `engine` (not a flag of its own).
    model: str | None = field(default=None, metadata={"flag": False})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (bf16 on CUDA and on CPUs with AVX512_BF16 or AMX, else fp32) | float32 | bfloat16 | float16"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (power of two >= 8)"})
    kv_cache_gb: float = field(default=1.0, metadata={"help": "KV cache size on the CPU, in GiB"})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV cache precision: auto (float16 under a float32 model on a CPU with F16C and the native "
            "kernels: half the memory; else the model's dtype) | float32 | bfloat16 | float16 (other than the "
            "model's dtype: CPU only)"
        },
    )
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "fraction of GPU memory to use"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "override the number of KV blocks"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens in one step"})
    prompt_logprob_cost: float = field(
        default=1.0,
        metadata={
            "help": "step-budget tokens a prompt-logprobs row costs beyond its own token (lm_head, "
            "log_softmax and top-k over the vocabulary): such prompts are prefilled in smaller chunks"
        },
    )
    prefill_tokens_while_decoding: int = field(
        default=256,
        metadata={
            "help": "most prompt tokens in a step that also decodes running streams: a long prompt "
            "is prefilled in chunks this small while others stream, so their next token waits less"
        },
    )
    prefill_ms_while_decoding: float = field(
        default=20.0,
        metadata={
            "help": "about how long the prompt work of a step that also decodes running streams may take, "
            "in ms, or as long as a decode-only step where that is longer, as estimated from the steps "
            "before (a prompt token costs more at a long context and on a busy machine); at least 8 "
            "budget tokens a step (a prompt-logprobs row counts more); 0: only "
            "--prefill-tokens-while-decoding bounds it"
        },
    )
    prefill_ms_alone: float = field(
        default=1000.0,
        metadata={
            "help": "about how long a step of prompt work with nothing decoding beside it may take, in ms, "
            "as estimated from the steps before, a chunk priced by its tokens and the context its "
            "attention reads (a lone long prompt is prefilled in steps this long, not in steps that grow "
            "with its context); 0: only --max-num-batched-tokens bounds it"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length cap; default: the model's"}
    )
    max_waiting: int = field(default=1024, metadata={"help": "most requests waiting in the engine"})
    watermark: float = field(default=0.01, metadata={"help": "fraction of blocks kept free for decodes"})
    preemption_mode: str = field(default="recompute", metadata={"help": "recompute | swap"})
    swap_space_gb: float = field(default=0.5, metadata={"help": "CPU swap space for preempted KV, in GiB"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    encoder_cache_mb: float = field(
        default=256.0,
        metadata={
            "help": "a model that sees: MiB of image encoder outputs kept (on the model's device) so that an image "
            "seen again is not encoded again; 0: none kept beyond the requests reading them"
        },
    )
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton"})
    cpu_gemm: str = field(
        default="auto",
        metadata={
            "help": "CPU linear layers: auto (oneDNN with packed weights where torch has it) | onednn | torch"
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": "auto (a GGUF's quantized blocks kept as they are on the CPU; none for other checkpoints) | none (dequantize at load) | "
            + " | ".join(QUANTIZE_AT_LOAD)
            + " (quantize a float checkpoint at load)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for unseeded sampling"})
    structured_compile_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "longest a request waits for its structured-output spec to compile: an error past it"
        },
    )
    stall_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "an engine whose step (or work between steps) runs this long is stuck: its requests go back to "
            "the queue (Redis) or fail with engine_stalled, and the process exits (code 3) for its supervisor "
            "to restart (docs/reliability.md)"
        },
    )
    stall_factor: float = field(
        default=4.0,
        metadata={
            "help": "and runs past this many times the longest of its last steps: a step is stuck only past "
            "both bounds, so a long prompt's chunks, each a little longer than the last, are not"
        },
    )
    structured_index_at_start: bool = field(
        default=False,
        metadata={
            "help": "build structured output's tokenizer index when the model loads (100+ MB resident "
            "from then on) instead of when the first structured request arrives (which then waits for it)"
        },
    )
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})
    gil_switch_ms: float = field(
        default=0.0,
        metadata={
            "help": "how long another Python thread of the engine's process (the gateway's, in wsllm serve) "
            "may keep the GIL from the step thread, which gives it up at every operator "
            "(sys.setswitchinterval, e.g. 0.5; Python's own is 5 ms); 0: leave Python's"
        },
    )
    fake_step_ms: float | None = field(default=None, metadata={"help": "no model: N ms steps, fixed tokens"})
    pooling: str = field(
        default="auto",
        metadata={
            "help": "how /v1/embeddings pools the last hidden states: auto (the model's default: last "
            "for the decoder-only chat models served here, as vLLM) | last | mean"
        },
    )
    speculative: str = field(
        default="off",
        metadata={
            "help": "speculative decoding: off | ngram (drafts from the sequence's own earlier tokens: answers "
            "that quote their input) | draft (a smaller model with the same tokenizer, --draft-model); "
            "verified exactly (greedy output unchanged) and only where the measured step cost says a draft "
            "pays (docs/speculative.md)"
        },
    )
    num_speculative_tokens: int = field(
        default=8,
        metadata={
            "help": "most draft tokens a sequence verifies in a step (1-15); the engine picks fewer, or "
            "none, from the sequence's recent acceptance and the measured cost of a step's rows"
        },
    )
    speculative_ngram_min: int = field(
        default=2, metadata={"help": "--speculative ngram: the shortest suffix looked up in the context"}
    )
    speculative_ngram_max: int = field(
        default=4, metadata={"help": "--speculative ngram: the longest suffix looked up in the context"}
    )
    speculative_adaptive: bool = field(
        default=True,
        metadata={
            "help": "pick each sequence's drafts from its acceptance and the measured step cost; false: "
            "verify every draft the proposer offers, up to --num-speculative-tokens (for measuring)"
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={
            "help": "--speculative draft: the draft model (an HF directory or a GGUF file) with the "
            "target's tokenizer, run in this engine with a KV cache of its own"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "run every step eagerly: no CUDA graphs (on CUDA a decode-only step otherwise replays "
            "a graph captured at start, one per batch bucket)"
        },
    )
    static_decode: str = field(
        default="auto",
        metadata={
            "help": "decode-only steps over static inputs padded to a batch bucket: auto (on CUDA, replayed "
            "from CUDA graphs unless --enforce-eager) | on (also on the CPU, as a plain call: what the "
            "tests use to check the padding) | off (the packed eager step everywhere)"
        },
    )
    lora: list[str] = field(
        default_factory=list,
        metadata={
            "help": "a LoRA adapter to serve on the base, NAME=PATH (a PEFT directory: adapter_config.json and "
            "adapter_model.safetensors), repeatable; a request picks it with model: NAME (docs/lora.md)"
        },
    )
    max_loras: int = field(
        default=8,
        metadata={
            "help": "most LoRA adapters resident at once (vLLM's): the others registered are read from their "
            "path when a request needs one, in place of the one used longest ago"
        },
    )
    max_registered_loras: int = field(
        default=1024,
        metadata={"help": "most LoRA adapters registered (--lora and POST /v1/load_lora_adapter together)"},
    )
    max_lora_rank: int = field(
        default=64, metadata={"help": "the largest LoRA rank an adapter may have (1-256)"}
    )
    allow_adapter_dir: str | None = field(
        default=None,
        metadata={
            "help": "the directory POST /v1/load_lora_adapter may load adapters from (and below it); unset: "
            "run-time loads are refused (--lora at start is always read)"
        },
    )

    def __post_init__(self) -> None:
        self._check_speculative()
        self._check_lora()
        if self.pooling not in ("auto", "last", "mean"):
            raise ValueError(f"pooling must be auto, last or mean, got {self.pooling!r}")
        bs = self.block_size
        if bs < 8 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 8, got {bs}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.prefill_tokens_while_decoding < 1:
            raise ValueError("prefill_tokens_while_decoding must be >= 1")
        if not self.prefill_ms_while_decoding >= 0:
            raise ValueError(f"prefill_ms_while_decoding must be >= 0, got {self.prefill_ms_while_decoding}")
        if not self.prefill_ms_alone >= 0:
            raise ValueError(f"prefill_ms_alone must be >= 0, got {self.prefill_ms_alone}")
        if not 0 <= self.gil_switch_ms <= 1000:
            raise ValueError(f"gil_switch_ms must be within 0 and 1000, got {self.gil_switch_ms}")
        if not self.prompt_logprob_cost >= 0:
            raise ValueError(f"prompt_logprob_cost must be >= 0, got {self.prompt_logprob_cost}")
        if not self.encoder_cache_mb >= 0:
            raise ValueError(f"encoder_cache_mb must be >= 0, got {self.encoder_cache_mb}")
        if not self.stall_factor >= 1:
            raise ValueError(f"stall_factor must be >= 1, got {self.stall_factor}")
        for name in ("structured_compile_timeout_s", "fake_step_ms", "stall_timeout_s"):
            if (value := getattr(self, name)) is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}"
            )
        if self.cpu_gemm not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_gemm must be auto, onednn or torch, got {self.cpu_gemm!r}")
        if self.quantization not in ("auto", "none", *QUANTIZE_AT_LOAD):
            raise ValueError(
                f"quantization must be auto, none, {' or '.join(QUANTIZE_AT_LOAD)}, got {self.quantization!r}"
            )
        if self.static_decode not in ("auto", "on", "off"):
            raise ValueError(f"static_decode must be auto, on or off, got {self.static_decode!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )

    def lora_specs(self) -> dict[str, str]:
        """--lora's adapters: name -> path, in order; ValueError for a spec that is not NAME=PATH."""
        out: dict[str, str] = {}
        for spec in self.lora:
            name, eq, path = spec.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"--lora takes NAME=PATH, got {spec!r}")
            if name.strip() in out:
                raise ValueError(f"--lora names {name.strip()!r} twice")
            out[name.strip()] = path.strip()
        return out

    def _check_lora(self) -> None:
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_lora_rank must be within 1 and 256, got {self.max_lora_rank}")
        if self.max_loras < 1 or self.max_registered_loras < 1:
            raise ValueError(f"max_loras and max_registered_loras must be >= 1, got {self.max_loras}")
        if len(self.lora_specs()) > self.max_registered_loras:
            n, most = len(self.lora), self.max_registered_loras
            raise ValueError(f"{n} --lora adapters are more than --max-registered-loras {most}")

    def _check_speculative(self) -> None:
        if self.speculative not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative must be off, ngram or draft, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 15:  # k + 1 <= 16: a row the decode stack runs
            raise ValueError(
                f"num_speculative_tokens must be within 1 and 15, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= 16:
            raise ValueError("speculative_ngram_min and _max must satisfy 1 <= min <= max <= 16")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft and --draft-model go together")


def _field_type(cls: type, f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0]
    return t  # type: ignore[no-any-return]


def _parse(t: type, raw: str) -> Any:
    if typing.get_origin(t) is list:  # WSLLM_MODEL=a,b
        return [part.strip() for part in raw.split(",") if part.strip()]
    if t is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return t(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of `cls` (a config dataclass); a list field's flag may
    repeat. A field whose metadata says `flag: False` is set by the command itself; one
    with `choices` (a function, called here) takes only those values."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("flag", True) is False:
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        t = _field_type(cls, f)
        env = " or ".join(_env_names(f))
        help_ = f"{f.metadata.get('help', '')} [env {env}]"
        if t is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(t) is list:
            parser.add_argument(*flags, action="append", default=None, help=help_, dest=f.name)
        else:
            choices = f.metadata["choices"]() if "choices" in f.metadata else None
            parser.add_argument(*flags, type=t, default=None, help=help_, dest=f.name, choices=choices)


def _env_names(f: dataclasses.Field[Any]) -> list[str]:
    return ["WSLLM_" + f.name.upper(), *f.metadata.get("env_aliases", ())]


def from_args(cls: type[T], args: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build `cls` from CLI args, then WSLLM_* env vars, then defaults."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, f.name, None) if args is not None else None
        for env in _env_names(f) if value is None else ():
            raw = os.environ.get(env)
            if raw is not None and raw != "":
                value = _parse(_field_type(cls, f), raw)
                break
        if value is not None:
            kwargs[f.name] = value
    kwargs.update(overrides)
    return cls(**kwargs)
