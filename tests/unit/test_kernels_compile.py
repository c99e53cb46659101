"""The Triton kernels compile for a real GPU target, with no GPU present.

The interpreter (tests/unit/test_kernels*.py) checks what the kernels compute, but
it accepts programs that the GPU compiler rejects (a tl.dot under 16 rows, a
type mismatch between loop iterations, too much shared memory). This test runs
the kernels' host code in a subprocess where each launch is replaced by
`triton.compile(..., target=sm_90)`, through ptxas, which the triton wheel ships.
The first run compiles a dozen kernels (~45 s on 2 cores); later runs hit triton's cache.
Every kernel of the package (a `*_kernel` @triton.jit function) must compile at least
once: a launch that compiled nothing, or skipped a kernel, fails.

Run by hand for another architecture: `python tests/unit/test_kernels_compile.py 80`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# ------------------------------------------------------------ the subprocess


def _compile_instead_of_launch(arch: int) -> list[str]:
    """Patch JITFunction.run so a launch compiles for `arch`; returns the log."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    types = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
             torch.int64: "i64"}  # fmt: skip
    log: list[str] = []
    seen: set[str] = set()

    def scalar_type(v: object) -> str:
        if isinstance(v, torch.Tensor):
            return "*" + types[v.dtype]
        if isinstance(v, bool):
            return "i1"
        if isinstance(v, int):
            return "i32" if -(2**31) <= v < 2**31 else "i64"
        if isinstance(v, float):
            return "fp32"
        raise TypeError(f"no triton type for {type(v)}")

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        names = [p.name for p in self.params]
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        sig = {p.name: "constexpr" if p.is_constexpr else scalar_type(bound[p.name]) for p in self.params}
        consts = {(names.index(p.name),): bound[p.name] for p in self.params if p.is_constexpr}
        key = f"{self.fn.__name__} {sig} {sorted(map(str, consts.values()))}"
        if key in seen:
            return None
        seen.add(key)
        kernel = triton.compile(ASTSource(self, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                                options=options)  # fmt: skip
        log.append(f"{self.fn.__name__}: shared {kernel.metadata.shared} B")
        return None

    JITFunction.run = run  # type: ignore[method-assign]
    return log


def _launch_everything() -> None:
    import torch
    from wsllm.kernels import (
        activation,
        kv_store,
        moe_triton,
        norms,
        paged_attention,
        paged_decode,
        paged_prefill,
        rotary,
    )
    from wsllm.kernels.testing import edge_lens, make_paged_case, prefill_batch

    def cuda_flags(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
        return False, "ieee" if dtype == torch.float32 else "tf32"  # what a CUDA tensor would get

    paged_decode.dot_flags = cuda_flags
    paged_prefill.dot_flags = cuda_flags
    moe_triton.dot_flags = cuda_flags
    for dtype, group, head_dim in ((torch.bfloat16, 4, 128), (torch.float32, 3, 80)):
        case = make_paged_case(edge_lens(16), None, 16, 2, group, head_dim, dtype)
        paged_attention.paged_decode_attention_triton(*case.decode_args(), num_splits=1)
        paged_attention.paged_decode_attention_triton(*case.decode_args(), num_splits=3)
        lens, q_lens = prefill_batch("chunked", 16)
        case = make_paged_case(lens, q_lens, 16, 2, group, head_dim, dtype)
        paged_attention.paged_prefill_attention_triton(*case.prefill_args())
    dt = torch.bfloat16
    x = torch.randn(4, 2048).to(dt)
    w = torch.ones(2048, dtype=dt)
    norms.rms_norm_triton(x, w, 1e-5)
    norms.add_rms_norm_triton(x, x, w, 1e-5)
    qkv = torch.randn(3, 16, 128).to(dt)
    cs = rotary.compute_cos_sin_cache(128, 1e4, 16)
    rotary.rotary_embedding_triton(torch.arange(3), qkv[:, :8], qkv[:, 8:12], cs)
    activation.silu_and_mul_triton(torch.randn(3, 2 * 8192).to(dt))
    activation.gelu_tanh_and_mul_triton(torch.randn(3, 2 * 8192).to(dt))  # GeGLU (Gemma)
    cache = torch.zeros(4, 16, 4, 128, dtype=dt)
    kv_store.store_kv_triton(qkv[:, 8:12], qkv[:, 12:], cache, cache.clone(), torch.arange(3))
    for dtype in (torch.bfloat16, torch.float32):  # the experts' grouped GEMMs (8 experts, top-2)
        ids = torch.tensor([[0, 3], [1, 7], [3, 5]])
        gate_up, down = torch.randn(8, 2 * 96, 128).to(dtype), torch.randn(8, 128, 96).to(dtype)
        moe_triton.moe_experts_triton(torch.randn(3, 128).to(dtype), ids, torch.rand(3, 2), gate_up, down)


def _every_kernel() -> set[str]:
    """Every Triton kernel of wsllm.kernels: a @triton.jit function named `*_kernel` (the
    others are device functions the kernels call)."""
    from triton.runtime.jit import JITFunction
    from wsllm.kernels import _triton_common, elementwise, moe_triton, paged_decode, paged_prefill

    modules = (_triton_common, elementwise, paged_decode, paged_prefill, moe_triton)
    return {
        n for m in modules for n, f in vars(m).items() if isinstance(f, JITFunction) and n.endswith("_kernel")
    }


def main(arch: int) -> None:
    log = _compile_instead_of_launch(arch)
    _launch_everything()
    print("\n".join(log))
    print(f"compiled {len(log)} kernels for sm_{arch}")
    missing = sorted(_every_kernel() - {line.split(":")[0] for line in log})
    if missing or not log:  # a launch that compiled nothing passes no judgement
        print(f"never compiled: {missing or 'anything'}")
        sys.exit(1)


# ------------------------------------------------------------------ the test


def _ptxas_shipped() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton")
    if not _ptxas_shipped():
        pytest.skip("triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # every kernel of the package compiled, at least once each (not "compiled 0 kernels")
    count = int(proc.stdout.rsplit("compiled ", 1)[1].split()[0])
    assert count >= 7 and "never compiled" not in proc.stdout, proc.stdout[-2000:]


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
