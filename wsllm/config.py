"""One dataclass per component. Each field is declared once; the CLI flag
(`--kv-cache-gb`) and the environment variable (`WSLLM_KV_CACHE_GB`) are derived
from it. Precedence: CLI flag > environment > default."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = field(default=None, metadata={"help": "HF dir, .gguf file or hub id; default SmolLM2"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    dtype: str = field(default="auto", metadata={"help": "auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (power of two >= 8)"})
    kv_cache_gb: float = field(default=1.0, metadata={"help": "KV cache size on the CPU, in GiB"})
    gpu_memory_utilization: float = field(default=0.85, metadata={"help": "fraction of GPU memory to use"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "override the number of KV blocks"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "most tokens in one step"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length cap; default: the model's"})
    max_waiting: int = field(default=1024, metadata={"help": "most requests waiting in the engine"})
    watermark: float = field(default=0.01, metadata={"help": "fraction of blocks kept free for decodes"})
    preemption_mode: str = field(default="recompute", metadata={"help": "recompute | swap"})
    swap_space_gb: float = field(default=0.5, metadata={"help": "CPU swap space for preempted KV, in GiB"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton"})
    seed: int = field(default=0, metadata={"help": "seed for unseeded sampling"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})

    def __post_init__(self) -> None:
        bs = self.block_size
        if bs < 8 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 8, got {bs}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


@dataclass(slots=True)
class GatewayConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    broker: str = field(default="memory", metadata={"help": "memory | redis://host:port/db"})
    model_name: str | None = field(default=None, metadata={"help": "the model id served; default from the model"})
    api_key: str | None = field(default=None, metadata={"help": "require this bearer key on every route"})
    allowed_origins: str = field(default="", metadata={"help": "comma list of WS origins; empty = same-origin"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "largest HTTP body"})
    max_ws_message_bytes: int = field(default=1 << 20, metadata={"help": "largest WS message"})
    max_tokens_limit: int = field(default=4096, metadata={"help": "largest max_tokens accepted"})
    default_max_tokens: int = field(default=512, metadata={"help": "max_tokens when the client names none"})
    max_n: int = field(default=8, metadata={"help": "largest n accepted"})
    max_stop: int = field(default=8, metadata={"help": "most stop strings"})
    max_stop_len: int = field(default=128, metadata={"help": "longest stop string"})
    max_top_logprobs: int = field(default=20, metadata={"help": "largest top_logprobs"})
    max_requests_per_socket: int = field(default=32, metadata={"help": "concurrent requests per WebSocket"})
    max_queue_depth: int = field(default=256, metadata={"help": "requests waiting before 429"})
    heartbeat_s: float = field(default=10.0, metadata={"help": "SSE comment / WS ping interval"})
    frontend: bool = field(default=True, metadata={"help": "serve the chat UI at /"})


def _field_type(cls: type, f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0]
    return t  # type: ignore[no-any-return]


def _parse(t: type, raw: str) -> Any:
    if t is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return t(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of `cls` (a config dataclass)."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        t = _field_type(cls, f)
        env = "WSLLM_" + f.name.upper()
        help_ = f"{f.metadata.get('help', '')} [env {env}]"
        if t is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            parser.add_argument(flag, type=t, default=None, help=help_, dest=f.name)


def from_args(cls: type[T], args: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build `cls` from CLI args, then WSLLM_* env vars, then defaults."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, f.name, None) if args is not None else None
        if value is None:
            raw = os.environ.get("WSLLM_" + f.name.upper())
            if raw is not None and raw != "":
                value = _parse(_field_type(cls, f), raw)
        if value is not None:
            kwargs[f.name] = value
    kwargs.update(overrides)
    return cls(**kwargs)
