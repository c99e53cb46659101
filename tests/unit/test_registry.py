"""The model registry (wsllm/models/registry.py): each checkpoint finds its family by its HF
`architectures`, then its `model_type`, or its GGUF `general.architecture`; one that no family
runs is refused naming what it is and what is served; a family's config is its knobs."""

from __future__ import annotations

import pytest

from wsllm.models import registry
from wsllm.models.family import Family

BASE = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 64}  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "family"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "llama"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "llama"),
        ({"model_type": "qwen2"}, "qwen2"),  # no architectures: by model_type
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "qwen3"),
        ({}, "llama"),  # a bare config is a Llama's
    ],
)
def test_a_config_finds_its_family(cfg: dict, family: str) -> None:
    assert registry.for_hf(cfg).name == family
    assert registry.model_config(BASE | cfg).family == family


def test_an_architecture_no_family_runs_is_refused_naming_it() -> None:
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'GemmaForCausalLM' \(model_type 'gemma'\)"
    ):
        registry.for_hf({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'rwkv6'; served: .*llama"):
        registry.for_gguf("rwkv6")


def test_the_table_names_each_architecture_once() -> None:
    for attr in ("hf_architectures", "model_types"):
        names = [n for f in registry.FAMILIES for n in getattr(f, attr)]
        assert len(names) == len(set(names)), attr
    # a GGUF architecture once for files with experts and once for files without
    gguf = [(a, f.gguf_experts) for f in registry.FAMILIES for a in f.gguf_architectures]
    assert len(gguf) == len(set(gguf))
    assert (
        registry.for_gguf("llama").name == "llama"
        and registry.for_gguf("llama", experts=True).name == "mixtral"
    )
    assert len({f.name for f in registry.FAMILIES}) == len(registry.FAMILIES)


def test_a_familys_differences_are_its_config_fields() -> None:
    qwen2 = registry.model_config(BASE | {"model_type": "qwen2"})
    qwen3 = registry.model_config(BASE | {"model_type": "qwen3", "head_dim": 16})
    llama = registry.model_config(BASE | {"model_type": "llama"})
    assert (llama.qkv_bias, llama.qk_norm) == (False, "none")
    assert qwen2.qkv_bias and qwen3.qk_norm == "head" and qwen3.head_dim == 16


def test_a_familys_renames_map_its_tensor_names_onto_the_shared_layers() -> None:
    f = Family("x", registry.llama.config, hf_renames=((r"^block\.(\d+)\.", r"layers.\1."),))
    assert f.weight_name("model.block.3.self_attn.q_proj.weight") == "layers.3.self_attn.q_proj.weight"
    assert f.weight_name("lm_head.weight") == "lm_head.weight"


def test_what_no_layer_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        registry.model_config(BASE | {"model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="layer_types must name each"):
        registry.model_config(
            BASE
            | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["x"]}
        )
