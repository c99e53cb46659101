// The decode layer's small ops in one call each (kernels/cpu_ops.py): on a CPU every torch op
// costs microseconds of dispatch, and the reference versions of these take 5 to 15 ops.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace wsq {

// (rms_norm(x + residual) * weight, x + residual), or of x alone when residual is None; the
// rounding of kernels/norms.py (normalised row rounded to x's dtype before the weight).
// isa as silu_mul's.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps, int64_t isa);
// [T, 2 d] -> [T, d]: silu(gate) rounded to x's dtype, times up (kernels/activation.py). isa as
// quant.isa_index() chose it: bf16 rows take the vector path there (fvec.h), the rest plain loops.
torch::Tensor silu_mul(torch::Tensor x, int64_t isa);
// Rotary on the q and k heads of qkv [T, (H + 2 Hk) D] in place (cos, sin: float32 [T, D] with
// sin's first half negated, as cpu_attention's plan holds them), then k and v rows into the
// caches [blocks, block_size, Hk, D] at slots [T] (all valid).
void rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads);

}  // namespace wsq
