"""The Llama family over a paged KV cache: Llama 2/3 (llama3 rope scaling),
Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm, head_dim from the config) and SmolLM2.
Grouped-query attention, RMSNorm, SwiGLU, tied or untied embeddings. Attention
metadata is passed explicitly, never through a global.

The forward pass calls submodules' `forward()` directly: `nn.Module.__call__` checks
for hooks on every call, and a decode step of a small model on a CPU makes hundreds
of these calls, where that Python time is a large part of the step (py-spy in
docs/benchmarks.md). No hooks are used on these modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsllm import kernels

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    arch: str = "llama"
    qk_norm: bool = False  # RMSNorm over head_dim on each head of q and k, before rotary (Qwen3)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        model_type = cfg.get("model_type", "llama")
        if archs[0] not in SUPPORTED_ARCHS and model_type not in SUPPORTED_ARCHS.values():
            raise ValueError(f"unsupported architecture {archs[0]!r} (model_type {model_type!r})")
        if cfg.get("use_sliding_window"):  # Qwen2/3 configs carry it, off in every released model
            raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type") not in (None, "default") else None
        )
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            arch=model_type,
            qk_norm=model_type == "qwen3",
        )


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs to find each token's KV. Built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's tokens
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token
    max_seq_len: int = 0  # the longest context, so no kernel asks the device for it
    # CPU attention, planned once per step for every layer (None: the dispatched kernels)
    cpu_plan: kernels.CpuAttentionPlan | None = None
    # The step's LoRA adapters and their rows (models/lora.py: LoraBatch); None: no row has one
    lora: Any = None


def _quant_parts(m: nn.Module) -> list[Any] | None:
    """The quantized weights a projection runs: a QuantLinear's one, a SplitLinear's parts
    when each is a QuantLinear without a bias; None for anything else (a float layer)."""
    w = getattr(m, "qweight", None)
    if w is not None:
        return [w]
    parts = getattr(m, "parts", None)
    if parts is None:
        return None
    ws = [getattr(p, "qweight", None) for p in parts]
    if any(w is None for w in ws) or any(getattr(p, "qbias", None) is not None for p in parts):
        return None
    return ws


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # its index: which LoRA pieces its projections take
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.scale = c.head_dim**-0.5
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [num_tokens, (H + 2 Hk) * D]
        if meta.lora is not None:  # the adapters' deltas on their rows (slots: kernels/lora.py)
            meta.lora.apply(self.layer, 0, x, qkv)
        if self.qk_norm:
            self._norm_qk(qkv)
        if meta.cpu_plan is not None:  # rotary, KV store and attention in one CPU block
            o = kernels.cpu_attention_block(qkv, kv[0], kv[1], meta.cpu_plan, self.num_heads, self.scale)
            return self._out(o, meta.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            o = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
        else:
            o = kernels.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                self.scale,
                meta.max_query_len,
            )
        return self._out(o.reshape(t, self.q_size), meta.lora)

    def _out(self, o: torch.Tensor, lora: Any) -> torch.Tensor:  # [num_tokens, H * D] -> [num_tokens, hidden]
        y = self.o_proj.forward(o)
        if lora is not None:
            lora.apply(self.layer, 1, o, y)
        return y

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """QK-norm in place on the fused projection's output, so that both attention
        paths (the CPU block and the kernels) read normalized q and k as before."""
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        q.copy_(self.q_norm.forward(q))
        k.copy_(self.k_norm.forward(k))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj.forward(kernels.silu_and_mul(self.gate_up_proj.forward(x)))
        gate_up = self.gate_up_proj.forward(x)
        lora.apply(self.layer, 2, x, gate_up)
        h = kernels.silu_and_mul(gate_up)
        y = self.down_proj.forward(h)
        lora.apply(self.layer, 3, h, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c, layer)

    def forward(self, x, residual, positions, cos_sin, kv, meta):  # type: ignore[no-untyped-def]
        if residual is None:
            residual = x
            h = self.input_layernorm.forward(x)
        else:
            h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, positions, cos_sin, kv, meta)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h, meta.lora), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        # an explicit (empty) weight skips the random init, whose meta-device version
        # imports torch._dynamo: ~150 MB resident for the life of the server
        self.embed_tokens = nn.Embedding(
            c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # On the CPU even while the model is built on the meta device: the meta versions
        # of these ops import torch's Python decompositions, ~150 MB resident for good.
        with torch.device("cpu"):
            cs = kernels.compute_cos_sin_cache(
                c.head_dim, c.rope_theta, c.max_position_embeddings, c.rope_scaling
            )
        self.register_buffer("cos_sin_cache", cs, persistent=False)
        # A decode-only step over quantized weights runs its layers in one native call
        # (kernels.decode_stack: the same ops, the same bits). False: layer by layer in Python
        # (tests compare the two; bench/profile_step.py --fused off).
        self.fused_decode = True
        self._stack: tuple[Any, ...] | None = None  # (kv_caches, their first tensor, stack or None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # hidden states [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        plan = meta.cpu_plan
        if self.fused_decode and plan is not None and not plan.prefills and plan.decode_tables is not None:
            stack = self._decode_stack(kv_caches, x.dtype)
            lora = meta.lora  # its adapters' native weights and rows go in with the layers
            handles = [] if lora is None else lora.native_handles()
            if stack is not None and handles is not None:
                x, residual = stack.forward(
                    x, plan.cos, plan.sin, plan.slot_mapping, plan.decode_tables, plan.decode_lens,
                    kernels.cpu_ops.native_isa(), handles, [] if lora is None else lora.native_rows(),
                )  # fmt: skip
                x, _ = self.norm.forward(x, residual)
                return x
        residual = None
        cos_sin = self.cos_sin_cache
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, positions, cos_sin, kv, meta)
        x, _ = self.norm.forward(x, residual)
        return x

    def _decode_stack(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> Any:
        """The native decode stack over these caches, built on first use; None where a layer
        is not all quantized matmuls (a float projection, a bias past qkv, QK-norm) or the activations
        are not float32/bfloat16: those steps run layer by layer."""
        cached = self._stack
        if cached is not None and cached[0] is kv_caches and cached[1] is kv_caches[0][0]:
            return cached[2]
        stack = self._build_decode_stack(kv_caches, dtype)
        self._stack = (kv_caches, kv_caches[0][0], stack)
        return stack

    def _build_decode_stack(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> Any:
        c = self.config
        if c.qk_norm or dtype not in (torch.float32, torch.bfloat16):
            return None
        norms, projections, biases, caches = [], [], [], []
        for layer, (k, v) in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(getattr(m, "qbias", None) is not None for m in mods[1:]):
                return None
            for m in mods:
                parts = _quant_parts(m)
                if parts is None:
                    return None
                projections.append(parts)
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                if n.weight.dtype is not dtype or not n.weight.is_contiguous() or n.eps != c.rms_norm_eps:
                    return None
                norms.append(n.weight)
            biases.append(getattr(attn.qkv_proj, "qbias", None))
            caches.extend((k, v))
        scale = self.layers[0].self_attn.scale
        return kernels.decode_stack(norms, projections, biases, caches, c.num_heads, c.rms_norm_eps, scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # -> [rows, vocab] float32
        as_float = getattr(self.lm_head, "forward_float", None)  # a quantized head sums in fp32
        if as_float is not None:
            return as_float(hidden)
        return self.lm_head.forward(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up projections."""
        params = dict(self.named_parameters())
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        loaded: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, start, size = name, None, None
            for i, p in enumerate(parts):
                if p in fused:
                    dst, start, size = fused[p]
                    parts[i] = dst
                    target = ".".join(parts)
                    break
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            with torch.no_grad():
                param = params[target]
                if start is None:
                    param.copy_(w)
                else:
                    param.narrow(0, start, size).copy_(w)
            loaded.add(target)
        missing = set(params) - loaded - ({"lm_head.weight"} if c.tie_word_embeddings else set())
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
