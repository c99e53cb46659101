"""oneDNN's packed linear (the CPU default) against F.linear: the same numbers up to
summation order, with and without bias, in fp32 and bf16, at every batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wsllm.models.cpu_linear import PackedLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    if not onednn_available(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 96, generator=g) * 0.1)
    packed = PackedLinear(lin, batch_hint=32)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    with torch.inference_mode():
        for rows in (1, 3, 32, 77):  # the hint is a layout hint, not a shape
            x = torch.randn(rows, 96, generator=g).to(dtype)
            torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), **tol)


def test_packing_a_model_keeps_a_tied_embedding() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    m = Tied()
    expect = F.linear(torch.ones(2, 16), m.embed.weight)
    assert pack_linears(m) == 1
    assert isinstance(m.head, PackedLinear) and isinstance(m.embed, nn.Embedding)
    with torch.inference_mode():
        torch.testing.assert_close(m.head(torch.ones(2, 16)), expect)
