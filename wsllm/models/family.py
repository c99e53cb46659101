"""What the registry knows of a family (`Family`): the names its checkpoints go by and how their
config and tensor names become this package's (wsllm/models/registry.py holds the table); and a
GGUF's metadata read as an HF config (`GGUFMeta`, `gguf_base`: the keys every architecture spells
alike; a family adds its own with `gguf_config`).

A family file (llama.py, qwen3_moe.py, ...) is a config reader and one `Family`: its differences
from the others are the fields of the ModelConfig it returns, never a branch in a layer."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

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
    # None: it claims its GGUF architectures whatever the file; True (False): only a file with
    # (without) experts (`expert_count`): llama.cpp writes Mixtral as "llama" with experts
    gguf_experts: bool | None = None
    # a GGUF's metadata -> its HF config keys beyond gguf_base's (experts, multipliers, ...)
    gguf_config: Callable[[GGUFMeta], dict[str, Any]] | None = None
    # a vision family's image-side tensors, by the prefix of their names once "model." goes
    # (vision_model., connector.): not the text model's (wsllm/models/vision/)
    image_side: tuple[str, ...] = ()
    # a vision family's image side, built from (its config.json, its directory, its image-side
    # tensors, the text model's device and dtype): the engine's hook (models/vision/__init__.py,
    # `ImageSide`); None from it: this checkpoint cannot see (no image processor's config)
    vision: Callable[..., Any] | None = None
    # the checkpoint's tensors (renamed) -> the shared layers' tensors, where the family stores them
    # otherwise (gpt-oss's transposed, interleaved experts; its MXFP4 blocks and scales)
    hf_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]] | None = (
        None
    )
    _renames: tuple[tuple[re.Pattern[str], str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_renames", tuple((re.compile(p), r) for p, r in self.hf_renames))

    def hf_config_from_gguf(self, meta: GGUFMeta) -> dict[str, Any]:
        """The HF config.json a GGUF of this family stands for (its first HF architecture)."""
        cfg = gguf_base(meta) | {
            "architectures": [self.hf_architectures[0]],
            "model_type": self.model_types[0],
        }
        if self.gguf_config is not None:
            cfg.update(self.gguf_config(meta))
        return cfg

    def is_image_side(self, name: str) -> bool:
        """A checkpoint tensor of the family's image side (not the text model's)."""
        return bool(self.image_side) and name.removeprefix("model.").startswith(self.image_side)

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors as the shared layers name and lay them out."""
        renamed = ((self.weight_name(n), w) for n, w in weights)
        return iter(renamed) if self.hf_weights is None else self.hf_weights(renamed)

    def weight_name(self, name: str) -> str:
        """A checkpoint tensor's name as the shared layers spell it."""
        name = name.removeprefix("model.")
        for pattern, replacement in self._renames:
            name = pattern.sub(replacement, name)
        return name


class GGUFMeta:
    """A GGUF's metadata: `get("expert_count")` reads `<architecture>.expert_count`, a
    `general.` or `tokenizer.` key is read as it is."""

    def __init__(self, fields: dict[str, Any], tensor_names: set[str] | dict[str, Any]) -> None:
        self.fields = fields  # gguf.GGUFReader.fields
        self.tensor_names = tensor_names  # or a dict: name -> gguf's ReaderTensor (`tensor`)
        arch = fields.get("general.architecture")
        self.arch: str = arch.contents() if arch is not None else "llama"

    def key(self, name: str) -> str:
        return name if name.startswith(("general.", "tokenizer.")) else f"{self.arch}.{name}"

    def get(self, name: str, default: Any = None) -> Any:
        f = self.fields.get(self.key(name))
        return default if f is None else f.contents()

    def tensor(self, name: str) -> Any:
        """A small tensor's values as a float32 numpy array (Phi-3's LongRoPE factors), None when
        the file has none of that name or its tensors were not given."""
        t = self.tensor_names.get(name) if isinstance(self.tensor_names, dict) else None
        if t is None:
            return None
        from gguf import quants

        return quants.dequantize(t.data, t.tensor_type).astype("float32").reshape(-1)

    @property
    def experts(self) -> int:
        return int(self.get("expert_count", 0) or 0)


_TOKEN_IDS = (
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "padding_token_id"),
    ("unk_token_id", "unknown_token_id"),
)


def gguf_base(meta: GGUFMeta) -> dict[str, Any]:
    """The HF config keys every GGUF architecture spells alike (llama.cpp's names -> HF's)."""
    heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    vocab = meta.get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(meta.get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
        "head_dim": int(
            meta.get("attention.key_length") or meta.get("rope.dimension_count") or hidden // heads
        ),
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": float(meta.get("rope.freq_base", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "hidden_act": "silu",
    }
    for hf, key in _TOKEN_IDS:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
    return cfg
