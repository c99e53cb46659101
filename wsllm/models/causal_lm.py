"""The decoder-only language model every text family builds from its ModelConfig: embeddings
(times the embedding multiplier: Granite's, Gemma's sqrt(hidden)), the decoder layers
(wsllm/models/layers/), the final norm, the LM head (tied or not; logits divided by the logits
scaling, then soft-capped where the config says: Gemma 2) and the rotary tables (wsllm/models/
rope.py), over a paged KV cache. Attention metadata is passed explicitly, never through a global.

The forward pass calls submodules' `forward()` directly: `nn.Module.__call__` checks for hooks
on every call, and a decode step of a small model on a CPU makes hundreds of these calls, where
that Python time is a large part of the step (py-spy in docs/benchmarks.md). No hooks are used on
these modules.

A decode-only step over quantized weights runs its layers in one native call (the decode stack,
kernels/decode_stack.py), whose program each layer writes from its own steps (`native_ops`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from wsllm import kernels
from wsllm.models.config import ModelConfig
from wsllm.models.layers.attention import AttentionMetadata
from wsllm.models.layers.decoder import DecoderLayer
from wsllm.models.layers.norms import RMSNorm
from wsllm.models.rope import qkv_row_order, rotary_cache


class CausalLM(nn.Module):
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
        self.register_buffer("cos_sin_cache", rotary_cache(c), persistent=False)
        # A decode-only step over quantized weights runs its layers in one native call
        # (kernels.StackProgram: the same ops, the same bits). False: layer by layer in Python
        # (tests compare the two; bench/profile_step.py --fused off).
        self.fused_decode = True
        self._stack: tuple[Any, ...] | None = None  # (kv_caches, their first tensor, stack or None)
        # A model that sees: its family's image side (models/vision/__init__.py, `ImageSide`), which
        # the loader builds; not a submodule (the text model's passes, quantization, LoRA skip it)
        self.image_side: Any = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        # a step's image rows: (packed positions [k], rows [k, hidden]) that take the place of
        # those tokens' embeddings (the encoder's output at its placeholders: engine/encoder_step.py)
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # hidden states [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if image_rows is not None:
            x = x.index_copy(0, image_rows[0], image_rows[1].to(x.dtype))
        plan = meta.cpu_plan
        plans = [m.cpu_plan for m in meta.groups] if meta.groups else [plan]  # one per KV group
        if (
            image_rows is None
            and self.fused_decode
            and all(p is not None and not p.prefills and p.decode_tables is not None for p in plans)
        ):
            stack = self._decode_stack(kv_caches, x.dtype)
            lora = meta.lora  # its adapters' native weights and rows go in with the layers
            handles = [] if lora is None else lora.native_handles()
            if stack is not None and handles is not None:
                assert plan is not None
                cos, sin = _stack_rotary(plan)
                slots, tables = _stack_inputs(plans)
                x, residual = stack.forward(
                    x, cos, sin, slots, tables, plan.decode_lens,
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
        cannot run there (a float projection) or the activations are not float32/bfloat16:
        those steps run layer by layer."""
        cached = self._stack
        if cached is not None and cached[0] is kv_caches and cached[1] is kv_caches[0][0]:
            return cached[2]
        stack = self._build_decode_stack(kv_caches, dtype)
        self._stack = (kv_caches, kv_caches[0][0], stack)
        return stack

    def _build_decode_stack(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> Any:
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        prog = kernels.StackProgram(dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            if not layer.native_ops(prog, kv):
                return None
        return prog.build()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # -> [rows, vocab] float32
        as_float = getattr(self.lm_head, "forward_float", None)  # a quantized head sums in fp32
        logits = as_float(hidden) if as_float is not None else self.lm_head.forward(hidden).float()
        s, cap = self.config.logits_scaling, self.config.final_softcap
        logits = logits if s == 1.0 else logits / s
        return logits if cap <= 0 else torch.tanh(logits / cap) * cap  # Gemma 2's final soft-cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as the shared layers name them (Family.weight_name: a family's
        names renamed), fusing q/k/v into qkv_proj and gate/up into gate_up_proj; the norm
        offset folded into every norm's weight (Gemma's 1 + w, as llama.cpp's converter does),
        q's and k's rows in the order partial rotary needs (wsllm/models/rope.py)."""
        params = dict(self.named_parameters())
        c = self.config
        order = qkv_row_order(c)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        loaded: set[str] = set()
        for name, w in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            expert = _EXPERT.match(name)
            if expert is not None:
                self._load_expert(params, expert, w)
                loaded.add(_expert_param(expert))
                continue
            target, start, size = _fused_target(name, params, qkv)
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            if c.norm_offset and target.endswith("norm.weight"):
                w = w.float() + c.norm_offset  # in fp32, as HF computes 1 + w, then rounded once
            if order is not None and target.rpartition(".")[0].endswith("qkv_proj"):
                w = w[order] if start is None else w[order[start : start + size] - start]
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

    @staticmethod
    def _load_expert(params: dict[str, nn.Parameter], m: re.Match[str], w: torch.Tensor) -> None:
        """One expert's gate, up or down projection into the experts' stacked weights."""
        target = params.get(_expert_param(m))
        if target is None:
            raise KeyError(f"unexpected weight {m.group(0)!r}")
        e, which = int(m.group(2)), m.group(3)
        if e >= target.shape[0]:
            raise KeyError(f"{m.group(0)!r}: expert {e} of a layer of {target.shape[0]} experts")
        half = target.shape[1] // 2
        with torch.no_grad():
            if which == "down_proj":
                target[e].copy_(w)
            else:
                target[e].narrow(0, 0 if which == "gate_proj" else half, half).copy_(w)


def _stack_rotary(plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's cos and sin for the decode stack: each rotary table's rows, one after the other."""
    if not plan.rotary:
        return plan.cos, plan.sin
    return torch.cat([c for c, _ in plan.rotary]), torch.cat([s for _, s in plan.rotary])


# one expert's projection as per-expert checkpoints name it: layers.N.mlp.experts.E.gate_proj.weight
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _expert_param(m: re.Match[str]) -> str:
    return f"{m.group(1)}.{'down' if m.group(3) == 'down_proj' else 'gate_up'}"


def _fused_target(
    name: str, params: dict[str, nn.Parameter], qkv: dict[str, tuple[int, int]]
) -> tuple[str, int | None, int]:
    """(the parameter `name` goes into, its first row there or None for all of it, its rows):
    q/k/v_proj are row ranges of qkv_proj, gate/up_proj the halves of gate_up_proj."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # transformers 5's stacked experts
        return name.removesuffix("_proj"), None, 0
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in qkv:
            start, size = qkv[p]
            return ".".join([*parts[:i], "qkv_proj", *parts[i + 1 :]]), start, size
        if p in ("gate_proj", "up_proj"):
            target = ".".join([*parts[:i], "gate_up_proj", *parts[i + 1 :]])
            half = params[target].shape[0] // 2 if target in params else 0
            return target, 0 if p == "gate_proj" else half, half
    return name, None, 0


def _stack_inputs(plans: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode stack's slots and block tables: one KV group's ([n], [n, w]), or every group's
    stacked ([G, n], [G, n, w]; engine/kv_groups.py)."""
    if len(plans) == 1:
        return plans[0].slot_mapping, plans[0].decode_tables
    return torch.stack([p.slot_mapping for p in plans]), torch.stack([p.decode_tables for p in plans])
