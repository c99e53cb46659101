"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases on q, k, v and o, a learned sink
per head, 128-token windows on every other layer (HF's `layer_types`) and YaRN rotary; a mixture
of experts on every layer: a router with a bias, top-k on its logits then a softmax over the k,
experts with biases and the clamped SwiGLU ((clamp(up) + 1) * g * sigmoid(1.702 g), g =
min(gate, limit)).

HF checkpoints stack the experts transposed, gate and up interleaved (`gate_up_proj` [E, H, 2I]:
column 2j gate j, 2j + 1 up j; `down_proj` [E, I, H]): `hf_weights` turns them into the shared
layer's [E, 2I, H] (gate rows, then up rows) and [E, H, I]. The released HF checkpoints keep the
experts in MXFP4 (`*_blocks` and `*_scales`, transformers' `quantization_config` "mxfp4"): they
are de-quantized as they load (the model's dtype; the GGUF keeps them in their blocks instead).
llama.cpp's GGUF ("gpt-oss") keeps gate, up and down apart (MXFP4 in the released files), the
biases as `*.bias` and the sinks as `attn_sinks`; the swiglu limit is its `swiglu_clamp_exp` where
the file has one, else llama.cpp's constant (7), the alpha always llama.cpp's (1.702)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from wsllm.models.config import ModelConfig, MoeConfig, hf_base
from wsllm.models.family import Family, GGUFMeta


def config(cfg: dict[str, Any]) -> ModelConfig:
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ValueError(
            f"gpt-oss: a {quant!r}-quantized HF checkpoint is not supported (MXFP4 or float ones are)"
        )
    moe = MoeConfig(
        num_experts=cfg["num_local_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["intermediate_size"],
        gating="softmax_topk",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oai",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
    ]
    bias = bool(cfg.get("attention_bias", True))
    return hf_base(
        cfg,
        "gpt_oss",
        moe=moe,
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=int(cfg.get("sliding_window") or 0),
        layer_types=tuple(types),
        attn_sinks=True,
    )


def hf_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (named as the shared layers name them) in the shared layers'
    layout; an MXFP4 checkpoint's experts (`*_blocks` beside `*_scales`) de-quantized."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        if not name.endswith(("_blocks", "_scales")):
            yield name, _laid_out(name, w, transposed=True)
            continue
        base, part = name.rsplit("_", 1)
        got = pending.setdefault(base, {})
        got[part] = w
        if len(got) == 2:
            del pending[base]
            yield base, _laid_out(base, mxfp4_dequantize(got["blocks"], got["scales"]), transposed=False)
    if pending:
        raise KeyError(f"{sorted(pending)[0]}: MXFP4 blocks without their scales, or scales without blocks")


def _laid_out(name: str, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """gate_up: HF's [E, H, 2I] (or, de-quantized from blocks, [E, 2I, H]) with gate and up
    interleaved -> [E, 2I, H], each expert's gate rows then its up rows; down [E, I, H] (or
    [E, H, I]) -> [E, H, I]; gate_up's bias [E, 2I] interleaved -> gate's, then up's."""
    if name.endswith(".experts.gate_up_proj"):
        t = w.transpose(1, 2) if transposed else w
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    if name.endswith(".experts.down_proj"):
        return (w.transpose(1, 2) if transposed else w).contiguous()
    if name.endswith(".mlp.gate_up_bias"):
        return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1).contiguous()
    return w


#: E2M1's values by their 4 bits (OCP microscaling), as transformers' MXFP4 checkpoints read them
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An HF MXFP4 tensor -> float32 [..., G * 32]: blocks uint8 [..., G, 16] (byte j: value 2j in
    its low nibble, 2j + 1 in its high one), scales uint8 [..., G] (E8M0: 2 ** (s - 127))."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match their scales {list(scales.shape)}")
    lut = torch.tensor(_FP4, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [..., G, 32]
    out = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2)


def gguf_config(meta: GGUFMeta) -> dict[str, Any]:
    n = int(meta.get("block_count"))
    ff = int(meta.get("expert_feed_forward_length") or meta.get("feed_forward_length"))
    rope: dict[str, Any] = {"rope_theta": float(meta.get("rope.freq_base", 150000.0)), "rope_type": "default"}
    if meta.get("rope.scaling.type") == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": float(meta.get("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length")),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,  # as gpt-oss was trained (HF's config of it)
        }
    return {
        "num_local_experts": meta.experts,
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "intermediate_size": ff,
        "sliding_window": int(meta.get("attention.sliding_window", 128)),
        # llama.cpp's pattern for gpt-oss: the even layers windowed (HF's layer_types alike)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "rope_parameters": rope,
        "attention_bias": True,
        "swiglu_limit": _swiglu_limit(meta),
    }


def _swiglu_limit(meta: GGUFMeta) -> float:
    """The experts' clamp: llama.cpp's per-layer `swiglu_clamp_exp` where the file has it (one value
    for every layer here), else llama.cpp's constant for gpt-oss."""
    limits = {float(v) for v in meta.get("swiglu_clamp_exp", None) or []}
    if len(limits) > 1:
        raise ValueError(f"swiglu_clamp_exp differs between layers ({sorted(limits)}): one limit is served")
    return limits.pop() if limits else 7.0


FAMILY = Family(
    name="gpt_oss",
    config=config,
    hf_architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    gguf_architectures=("gpt-oss",),
    gguf_config=gguf_config,
    hf_renames=(
        (r"\.mlp\.router\.", ".mlp.gate."),
        (r"\.mlp\.experts\.gate_up_proj_bias$", ".mlp.gate_up_bias"),
        (r"\.mlp\.experts\.down_proj_bias$", ".mlp.down_bias"),
    ),
    hf_weights=hf_weights,
)
