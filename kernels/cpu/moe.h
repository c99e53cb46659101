// The mixture-of-experts pass's torch-free parts (moe.cpp holds the torch side): routing one row at a
// time, and the router's dot products in vectors (moe_simd.h, compiled for AVX-512 and AVX2).
#pragma once

#include <cstdint>

namespace wsq {

// MoeConfig.gating (kernels/moe.py: GATINGS)
enum Gating : int64_t { kSoftmax = 0, kSigmoid = 1, kSoftmaxTopk = 2 };

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
