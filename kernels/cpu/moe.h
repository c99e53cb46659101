// The mixture-of-experts pass's torch-free parts (moe.cpp holds the torch side): routing one row at a
// time, and the router's dot products in vectors (moe_simd.h, compiled for AVX-512 and AVX2).
#pragma once

#include <cmath>
#include <cstdint>

namespace wsq {

// MoeConfig.gating (kernels/moe.py: GATINGS)
enum Gating : int64_t { kSoftmax = 0, kSigmoid = 1, kSoftmaxTopk = 2 };
// MoeConfig.activation (kernels/moe.py: ACTIVATIONS): SwiGLU, or gpt-oss's clamped SwiGLU
enum ExpertActKind : int64_t { kSilu = 0, kSwigluOai = 1 };

// What the grouped pass adds to each expert's projections and how it activates them: biases on gate
// and up [E * I] and on down [E * H] (or null), and the activation of (gate, up).
struct ExpertEpilogue {
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
  int64_t act = kSilu;
  float alpha = 1.702f, limit = 7.0f;
};

// gpt-oss's clamped SwiGLU of one (gate, up) pair (kernels/moe.py: ExpertAct)
inline float swiglu_oai(float g, float u, float alpha, float limit) {
  g = g < limit || g != g ? g : limit;
  u = u < -limit ? -limit : u > limit ? limit : u;
  return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
}

struct RoutingKnobs {
  int64_t num_experts, top_k;
  int64_t gating;
  bool renormalize;
  float scale;
  const float* selection_bias;  // [E] added to the scores to choose (never to weigh), or null
};

// One row's logits [E] -> its top_k experts, ascending by id, and their weights (kernels/moe.py:
// route). `scratch` holds 3 E floats. Ties go to the lower expert id.
void route_row(const RoutingKnobs& r, const float* logits, float* scratch, int32_t* ids, float* weights);

// out[t * E + e] = x[t] . w[e] for rows t < T and experts e in [e0, e1): x [T, H], w [E, H] float32;
// each dot in one order whatever T (so a row's logits do not depend on its batch).
using RouterFn = void (*)(const float* x, const float* w, int64_t T, int64_t e0, int64_t e1, int64_t H, int64_t E,
                          float* out);
RouterFn router_logits_avx512();
RouterFn router_logits_avx2();
RouterFn router_logits_scalar();

}  // namespace wsq
