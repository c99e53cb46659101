"""The LoRA adapters an engine serves (`Adapters`): registered from `--lora NAME=PATH` at
start and by name at run time (the worker's `load_lora_adapter` / `unload_lora_adapter`), any
number of them (up to `--max-registered-loras`), each checked against the base as it registers
(models/lora.py). As vLLM's `--max-loras`, at most that many are resident (their weights in
memory); a request for another loads it from its path on demand, in place of the one used
longest ago. An evicted adapter's weights stay with the requests that run on it until they end.

A request names its adapter (`GenerateRequest.lora`); its sequences carry it
(`Sequence.lora`) through forks, preemption and swaps, and their prefix-cache chains start
from a root of the adapter's own (`adapter_root`): the same prompt under two adapters, or an
adapter and the base, never shares a KV block. The root is the adapter's content (a digest of
its files), not its name, so a name reloaded with other weights cannot meet the KV of the old.

Unloading takes the name away at once (new requests for it are refused); the requests that
run under it finish on it: their sequences hold the adapter until they end."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from wsllm.config import EngineConfig
from wsllm.models.config import ModelConfig
from wsllm.models.lora import AdapterError, LoraAdapter, load_adapter
from wsllm.prefix_hash import cache_root

log = logging.getLogger(__name__)


def adapter_root(root: bytes | None, adapter: LoraAdapter | None) -> bytes | None:
    """The prefix-cache root of a request: the caller's `root` (a tenant's namespace, or None:
    the common one) extended by its adapter's content; `root` itself without an adapter."""
    if adapter is None:
        return root
    return cache_root(root.hex() if root else "", f"lora:{adapter.digest}")


class AdapterNotFound(AdapterError, FileNotFoundError):
    """No adapter at the path a load names (vLLM answers 404); a FileNotFoundError, so that the
    worker's commands (commands.py, torch-free) tell it apart without importing this module."""


class Adapters:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_name: str = "",
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,  # the activations': bfloat16 keeps the pieces in bfloat16
    ) -> None:
        self.max_loras = config.max_loras  # resident at once
        self.max_registered = config.max_registered_loras
        self.max_rank = config.max_lora_rank
        self.model_config = model_config
        self.model_name = model_name
        self.device = device  # where the pieces live: the model's
        self.dtype = torch.bfloat16 if dtype is torch.bfloat16 else torch.float32
        self._paths: dict[str, str] = {}  # every registered adapter: name -> its directory
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # the resident, least recent first
        #: where run-time loads may read from (engine/commands.py checks; None: nowhere)
        self.allow_dir = config.allow_adapter_dir
        for name, path in config.lora_specs().items():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Register `path` as `name`, read and checked now (resident while there is room);
        AdapterNotFound without a directory there, AdapterError (a ValueError) saying why not."""
        if name in self._paths:
            raise AdapterError(f"the LoRA adapter {name!r} is already loaded")
        if name == self.model_name:
            raise AdapterError(f"{name!r} is the base model's name")
        if len(self._paths) >= self.max_registered:
            raise AdapterError(
                f"{len(self._paths)} adapters are registered (--max-registered-loras); unload one"
            )
        if not Path(path).expanduser().is_dir():
            raise AdapterNotFound(f"no adapter directory at {path}")
        adapter = self._read(name, path)
        self._paths[name] = path
        if len(self._held) < self.max_loras:
            self._held[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving `name`: KeyError when it is not loaded. Running requests finish on it."""
        del self._paths[name]
        self._held.pop(name, None)
        log.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names, read from its path when it is not resident (in place
        of the least recently used); ValueError when this engine does not serve it, or when
        its files no longer load."""
        adapter = self._held.get(name)
        if adapter is not None:
            self._held.move_to_end(name)
            return adapter
        path = self._paths.get(name)
        if path is None:
            held = f"; loaded here: {', '.join(self._paths)}" if self._paths else ""
            raise ValueError(f"the LoRA adapter {name!r} is not loaded on this engine{held}")
        adapter = self._read(name, path)
        while len(self._held) >= self.max_loras:
            self._held.popitem(last=False)
        self._held[name] = adapter
        return adapter

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = load_adapter(name, path, self.model_config, self.max_rank, self.device, self.dtype)
        log.info(
            "LoRA adapter %s read from %s: rank %d, %d modules, %.1f MB",
            name,
            path,
            adapter.rank,
            len(adapter.modules),
            adapter.nbytes / 1e6,
        )
        return adapter

    def names(self) -> list[str]:
        """Every adapter it serves (resident or not): what its heartbeat tells the gateways."""
        return list(self._paths)

    def resident(self) -> list[str]:
        """The adapters whose weights it holds now, the least recently used first."""
        return list(self._held)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._held.values())
