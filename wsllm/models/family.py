"""What the registry knows of a family (`Family`): the names its checkpoints go by and how their
config and tensor names become this package's (wsllm/models/registry.py holds the table).

A family file (llama.py, qwen3_moe.py, ...) is a config reader and one `Family`: its differences
from the others are the fields of the ModelConfig it returns, never a branch in a layer."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wsllm.models.config import ModelConfig


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    config: Callable[[dict[str, Any]], ModelConfig]  # an HF config.json -> the model's config
    hf_architectures: tuple[str, ...] = ()  # HF `architectures[0]` names
    model_types: tuple[str, ...] = ()  # HF `model_type` names
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture` names
    # (pattern, replacement) applied in order to each checkpoint tensor's name (after "model."
    # goes): the family's names -> the shared layers' (see CausalLM.load_weights)
    hf_renames: tuple[tuple[str, str], ...] = ()
    # llama.cpp's converter permutes this architecture's Q and K rows for its rotary layout
    # (gguf_weights.py undoes it)
    gguf_permuted_qk: bool = False
    _renames: tuple[tuple[re.Pattern[str], str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_renames", tuple((re.compile(p), r) for p, r in self.hf_renames))

    def weight_name(self, name: str) -> str:
        """A checkpoint tensor's name as the shared layers spell it."""
        name = name.removeprefix("model.")
        for pattern, replacement in self._renames:
            name = pattern.sub(replacement, name)
        return name
