"""The LoRA adapters an engine holds (`Adapters`): loaded from `--lora NAME=PATH` at start
and by name at run time (the worker's `load_lora_adapter` / `unload_lora_adapter`), at most
`--max-loras` at once, each checked against the base as it loads (models/lora.py).

A request names its adapter (`GenerateRequest.lora`); its sequences carry it
(`Sequence.lora`) through forks, preemption and swaps, and their prefix-cache chains start
from a root of the adapter's own (`adapter_root`): the same prompt under two adapters, or an
adapter and the base, never shares a KV block. The root is the adapter's content (a digest of
its files), not its name, so a name reloaded with other weights cannot meet the KV of the old.

Unloading takes the name away at once (new requests for it are refused); the requests that
run under it finish on it: their sequences hold the adapter until they end."""

from __future__ import annotations

import logging

import torch

from wsllm.config import EngineConfig
from wsllm.models.llama import ModelConfig
from wsllm.models.lora import AdapterError, LoraAdapter, load_adapter
from wsllm.prefix_hash import cache_root

log = logging.getLogger(__name__)


def adapter_root(root: bytes | None, adapter: LoraAdapter | None) -> bytes | None:
    """The prefix-cache root of a request: the caller's `root` (a tenant's namespace, or None:
    the common one) extended by its adapter's content; `root` itself without an adapter."""
    if adapter is None:
        return root
    return cache_root(root.hex() if root else "", f"lora:{adapter.digest}")


class Adapters:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_name: str = "",
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,  # the activations': bfloat16 keeps the pieces in bfloat16
    ) -> None:
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.model_config = model_config
        self.model_name = model_name
        self.device = device  # where the pieces live: the model's
        self.dtype = torch.bfloat16 if dtype is torch.bfloat16 else torch.float32
        self._held: dict[str, LoraAdapter] = {}
        #: where run-time loads may read from (engine/commands.py checks; None: nowhere)
        self.allow_dir = config.allow_adapter_dir
        for name, path in config.lora_specs().items():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Load and hold `path` as `name`; AdapterError (a ValueError) saying why not."""
        if name in self._held:
            raise AdapterError(f"the LoRA adapter {name!r} is already loaded")
        if name == self.model_name:
            raise AdapterError(f"{name!r} is the base model's name")
        if len(self._held) >= self.max_loras:
            raise AdapterError(
                f"{len(self._held)} adapters are loaded, the most this engine holds (--max-loras); unload one first"
            )
        adapter = load_adapter(name, path, self.model_config, self.max_rank, self.device, self.dtype)
        self._held[name] = adapter
        log.info(
            "LoRA adapter %s loaded from %s: rank %d, %d modules, %.1f MB",
            name, path, adapter.rank, len(adapter.modules), adapter.nbytes / 1e6,
        )  # fmt: skip
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving `name`: KeyError when it is not loaded. Running requests finish on it."""
        del self._held[name]
        log.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names; ValueError when this engine does not hold it."""
        adapter = self._held.get(name)
        if adapter is None:
            held = f"; loaded here: {', '.join(self._held)}" if self._held else ""
            raise ValueError(f"the LoRA adapter {name!r} is not loaded on this engine{held}")
        return adapter

    def names(self) -> list[str]:
        return list(self._held)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._held.values())
