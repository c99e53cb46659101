"""The decode stack's program: a model's decode-only step written as the native ops its layers run,
in their order, so that one C++ call (kernels/cpu/decode_stack.cpp: DecodeStack) runs every layer
without Python between the ops. The model describes its layers (each module's `native_ops` writes
its own steps here, beside its `forward`); the C++ side only interprets: it holds no copy of any
layer's order. The ops call the same kernels the Python modules call, so a step gives the same bits
either way (tests/unit/test_quantized_model.py).

Registers: `x` (the running activation) and `residual`. The ops:

    norm(w, eps)      x, residual = add_rms_norm(x, residual)  (no residual yet: residual = x first)
    linear(module)    x = x @ W^T (+ bias) over quantized parts (+ the step's LoRA deltas, by key)
    qk_norm(...)      RMSNorm of x's q and k parts in place (per head, or over the whole part)
    attention(k, v)   x = rotary + KV store + paged decode attention of the fused qkv x (with the
                      layer's window, soft-cap and sinks, where it has them; by its rotary table)
    silu_mul()        x = silu(gate) * up
    gelu_mul()        x = gelu_tanh(gate) * up (GeGLU)
    rms_norm(w, eps)  x = rms_norm(x), the residual untouched (Gemma's sandwich norms)
    scale(m)          x = x * m
    moe(layer)        x = the mixture of experts (kernels/moe.py: MoeNative, the Python layer's own call)
"""

from __future__ import annotations

from typing import Any

import torch

from .cpu_ops import native_ext

# op codes, kernels/cpu/decode_stack.h: StackOp
NORM, LINEAR, ATTENTION, SILU_MUL, SCALE, QK_NORM, MOE, GELU_MUL, RMS_NORM = range(9)


class StackProgram:
    """A decode stack being written: flat ints (op code, then its arguments) over a list of
    tensors and a list of floats, as kernels/cpu/decode_stack.h reads them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # the activations': float32 or bfloat16
        self.program: list[int] = []
        self.tensors: list[torch.Tensor] = []
        self.floats: list[float] = []
        self.moes: list[Any] = []  # the native MoE layers the program's moe ops run

    def _tensor(self, t: torch.Tensor) -> int:
        self.tensors.append(t)
        return len(self.tensors) - 1

    def _float(self, v: float) -> int:
        self.floats.append(float(v))
        return len(self.floats) - 1

    def _ours(self, w: torch.Tensor) -> bool:
        return w.dtype is self.dtype and w.is_contiguous()

    def norm(self, weight: torch.Tensor, eps: float) -> bool:
        if not self._ours(weight):
            return False
        self.program += [NORM, self._tensor(weight), self._float(eps)]
        return True

    def rms_norm(self, weight: torch.Tensor, eps: float) -> bool:
        """`RMSNorm.forward(x)` without a residual: x normed, the residual as it was."""
        if not self._ours(weight):
            return False
        self.program += [RMS_NORM, self._tensor(weight), self._float(eps)]
        return True

    def linear(self, module: Any, lora_key: int = -1) -> bool:
        """A projection over quantized weights (QuantLinear, SplitLinear: `native_parts`);
        False for anything else (a float layer runs layer by layer)."""
        native_parts = getattr(module, "native_parts", None)
        found = native_parts() if native_parts is not None else None
        if found is None:
            return False
        weights, bias = found
        if bias is not None and not self._ours(bias):
            return False
        from . import quant

        self.program += [LINEAR, len(weights), -1 if bias is None else self._tensor(bias), lora_key]
        for w in weights:
            self.program += [self._tensor(w.packed), quant.QTYPES.index(w.qtype), w.out_features]
        return True

    def qk_norm(
        self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, q_size: int, kv_size: int
    ) -> bool:
        if not (self._ours(q_weight) and self._ours(k_weight)):
            return False
        self.program += [
            QK_NORM,
            self._tensor(q_weight),
            self._tensor(k_weight),
            self._float(eps),
            q_size,
            kv_size,
        ]
        return True

    def attention(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        rope: int = 0,
        group: int = 0,
    ) -> None:
        """`window`, `softcap`, `sinks`: the layer's attention variant (kernels/paged_attention.py),
        each off by default; `rope`: its rotary table (CpuAttentionPlan.rotary; 0: the model's first);
        `group`: the KV group whose slots and block tables it reads (a model of several windows,
        engine/kv_groups.py: the stack's inputs are then one per group)."""
        self.program += [
            ATTENTION,
            self._tensor(k_cache),
            self._tensor(v_cache),
            num_heads,
            self._float(scale),
            int(window),
            self._float(softcap),
            -1 if sinks is None else self._tensor(sinks.float().contiguous()),
            int(rope),
            int(group),
        ]

    def silu_mul(self) -> None:
        self.program.append(SILU_MUL)

    def gelu_mul(self) -> None:
        self.program.append(GELU_MUL)

    def scale(self, m: float) -> None:
        self.program += [SCALE, self._float(m)]

    def moe(self, layer: Any) -> None:
        """`layer`: a kernels.moe.MoeNative."""
        self.program += [MOE, len(self.moes)]
        self.moes.append(layer.handle)

    def build(self) -> Any:
        """The native DecodeStack of this program (checked there), or None without the native
        build. `.forward(x, cos, sin, slots, tables, lens, isa, lora, lora_rows)` -> (x, residual); cos
        and sin: each rotary table's rows of the step, one table after the other; slots [n] and
        tables [n, w], or [G, n] and [G, n, w]: per KV group."""
        ext = native_ext()
        if ext is None:
            return None
        return ext.DecodeStack(self.program, self.tensors, self.floats, self.moes)
