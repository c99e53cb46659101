"""Linear layers on the CPU through oneDNN, with weights packed once at load.

Measured on the 2-core AMD EPYC (AVX2, docs/benchmarks.md): torch's `F.linear` goes
to MKL's sgemm, which runs far below the machine's limit on this CPU; oneDNN's
matmul over weights reordered once into its blocked layout ran SmolLM2's weight
shapes 1.7x faster at batch 1 and about 2x at batch 8 to 32. vLLM's CPU build uses
oneDNN the same way. The results differ from `F.linear` only in summation order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def _raw_linear_op() -> Any:
    """The oneDNN linear as a bare builtin: `torch.ops.x.y(...)` goes through two
    Python-level wrappers (packet, overload) on every call."""
    overload = torch.ops.mkldnn._linear_pointwise.default
    return getattr(overload, "_op", overload)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack and run weights of this dtype here (bf16 needs AVX512
    or AVX-NE-CONVERT; torch raises on other CPUs)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        with torch.inference_mode():
            w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), w, None, "none", [], "")
    except RuntimeError as e:
        log.info("oneDNN cannot run %s linear layers here: %s", dtype, e)
        return False
    return True


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W in oneDNN's layout (an opaque mkldnn tensor)."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.weight_dtype = w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._op = _raw_linear_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in] -> [num_tokens, out]
        return self._op(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear (CPU; fp32, and bf16
    where oneDNN supports it here; the others stay as they are).
    A weight tied to another module (the embedding) stays where it is; the packed
    copy is the linear's own. Returns how many layers were packed."""
    ok = {dt: onednn_available(dt) for dt in (torch.float32, torch.bfloat16)}
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and ok.get(child.weight.dtype)
    ]
    with torch.inference_mode():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child, batch_hint))
    log.info("packed %d linear layers for oneDNN (batch hint %d)", len(targets), batch_hint)
    return len(targets)
