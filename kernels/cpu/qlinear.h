// The torch entry points of the quantized matmul (qgemm.cpp), for the bindings and the decode stack.
// The kernels themselves (qgemm.h, qgemm_*.cpp) compile without torch.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace wsq {

// One quantized part of a projection: packed weights of `n` output rows in format `qtype`.
struct QPart {
  torch::Tensor packed;
  int64_t qtype = 0, n = 0;
};

// x [M, K] float32 or bfloat16 -> [M, n] in x's dtype, or float32 when out_float; packed weights
// uint8 [groups, blocks, bytes] of `qtype`, bias (float) [n] or none; isa as quant.isa_index().
torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t n,
                      c10::optional<torch::Tensor> bias, int64_t isa, bool out_float);
// A projection of one part (QuantLinear.forward) or several side by side then + bias
// (SplitLinear.forward); x's dtype.
torch::Tensor project(const torch::Tensor& x, const std::vector<QPart>& parts, const c10::optional<torch::Tensor>& bias,
                      int64_t isa);
// rows int64 [R] of the packed weights of n rows -> float32 [R, K]: embedding lookups, dequantization.
torch::Tensor dequant_rows(torch::Tensor packed, int64_t qtype, int64_t n, torch::Tensor rows);
// How many of torch's threads an at::parallel_for of this module runs on (1 without OpenMP).
int64_t parallel_threads();

}  // namespace wsq
