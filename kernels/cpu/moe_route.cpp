// Routing one row at a time (moe.h: route_row) and the router's scalar dot products: the knobs of
// MoeConfig in the order kernels/moe.py's route applies them.
#include <algorithm>
#include <cmath>
#include <limits>

#include "moe.h"

namespace wsq {

void route_row(const RoutingKnobs& r, const float* logits, float* scratch, int32_t* ids, float* weights) {
  const int64_t E = r.num_experts, k = r.top_k;
  float* score = scratch;       // what weighs
  float* choose = scratch + E;  // what chooses
  if (r.gating == kSoftmax) {
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    for (int64_t e = 0; e < E; ++e) sum += (score[e] = std::exp(logits[e] - mx));
    for (int64_t e = 0; e < E; ++e) score[e] = score[e] / sum;
  } else if (r.gating == kSigmoid) {
    for (int64_t e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    for (int64_t e = 0; e < E; ++e) score[e] = logits[e];
  }
  float* taken = scratch + 2 * E;  // 1: chosen already
  for (int64_t e = 0; e < E; ++e) {
    choose[e] = r.selection_bias ? score[e] + r.selection_bias[e] : score[e];
    taken[e] = 0.0f;
  }
  for (int64_t j = 0; j < k; ++j) {  // the best untaken; ties to the lowest id (a NaN never wins)
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (taken[e] == 0.0f && (best < 0 || choose[e] > choose[best] || std::isnan(choose[best]))) best = e;
    ids[j] = int32_t(best);
    taken[best] = 1.0f;
  }
  std::sort(ids, ids + k);  // ascending: every sum below runs in the row's own order
  if (r.gating == kSoftmaxTopk) {
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) mx = std::max(mx, logits[ids[j]]);
    for (int64_t j = 0; j < k; ++j) sum += (weights[j] = std::exp(logits[ids[j]] - mx));
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / sum;
  } else {
    for (int64_t j = 0; j < k; ++j) weights[j] = score[ids[j]];
  }
  if (r.renormalize) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += weights[j];
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / sum;
  }
  if (r.scale != 1.0f)
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] * r.scale;
}

namespace {

void router_scalar(const float* x, const float* w, int64_t T, int64_t e0, int64_t e1, int64_t H, int64_t E,
                   float* out) {
  for (int64_t e = e0; e < e1; ++e)
    for (int64_t t = 0; t < T; ++t) {
      float s = 0.0f;
      for (int64_t j = 0; j < H; ++j) s += x[t * H + j] * w[e * H + j];
      out[t * E + e] = s;
    }
}

}  // namespace

RouterFn router_logits_scalar() { return router_scalar; }

}  // namespace wsq
