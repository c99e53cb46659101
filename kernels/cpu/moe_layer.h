// The mixture-of-experts layer on the CPU (kernels/moe.py: MoeNative): router, routing, the grouped
// pass over the chosen experts' quantized blocks and the shared expert, in one call that the Python
// layer and the decode stack both make.
//
// The grouped pass (moe.cpp) per chunk of up to kMoeChunkRows rows:
//   1. x quantized once (gate's and up's blocks), every (row, expert) pair counting-sorted by expert
//      (stable: an expert's rows in row order), each pair's quantized row gathered in that order;
//   2. gate and up: for every chosen expert and every group of 16 of its intermediate rows, both
//      projections' tiles over all of its rows, SiLU(gate) * up in float32 as they come out;
//   3. each pair's hidden row quantized once (down's blocks);
//   4. down: for every chosen expert and group of 16 output rows, the tile over its rows, times each
//      pair's routing weight (folded into the sum), into the pair's own output row;
//   5. each row's k outputs summed in the order of its (ascending) expert ids.
// Steps 2 and 4 are one loop over (expert, group) items each, on the decode stack's team of threads
// (team.h) or torch's: a few chosen experts still split across both cores. A row's bits depend only
// on its own values and experts: each tile computes its rows independently, and the sums run in an
// order the row fixes (the kernels' tiles give a row the same bits whatever the tile's size).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "moe.h"
#include "qlinear.h"

namespace wsq {

constexpr int64_t kMoeChunkRows = 256;  // rows per pass: bounds its buffers (P = rows * k pairs)

class MoeLayer {
 public:
  // router float32 [E, H]; selection_bias float32 [E] or empty; experts: gate [E * I, H], up [E * I, H],
  // down [E * H, I] packed (kernels/moe.py: QuantExperts) in formats qtypes; shared: the shared
  // expert's gate_up parts then its down parts (`shared_gate_up` of them gate_up's), or none;
  // shared_gate float32 [H] (the shared output times sigmoid(x . gate)) or empty; biases: float32 the
  // router's [E] (added to its logits), gate's and up's [E * I], down's [E * H], each or empty; act
  // (ExpertActKind) with its alpha and limit.
  MoeLayer(torch::Tensor router, torch::Tensor selection_bias, std::vector<torch::Tensor> experts,
           std::vector<int64_t> qtypes, int64_t top_k, int64_t gating, bool renormalize, double scale,
           std::vector<torch::Tensor> shared, std::vector<int64_t> shared_qtypes, std::vector<int64_t> shared_ns,
           int64_t shared_gate_up, torch::Tensor shared_gate, std::vector<torch::Tensor> biases = {},
           int64_t act = kSilu, double alpha = 1.702, double limit = 7.0);

  // x [T, H] float32 or bfloat16 -> the layer's output [T, H] in x's dtype
  torch::Tensor forward(const torch::Tensor& x, int64_t isa) const;
  // x -> (ids int32 [T, k] ascending per row, weights float32 [T, k]): the router's choice (tests)
  std::vector<torch::Tensor> route(const torch::Tensor& x, int64_t isa) const;
  // the grouped pass alone over a given routing -> float32 [T, H] (tests: any routing)
  torch::Tensor experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                        int64_t isa) const;

  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return knobs_.top_k; }

 private:
  void route_rows(const float* x, int64_t T, int64_t isa, int32_t* ids, float* weights) const;
  void grouped(const void* x, bool bf16, int64_t T, const int32_t* ids, const float* weights, int64_t isa,
               float* out) const;
  torch::Tensor shared_expert(const torch::Tensor& x, int64_t isa) const;

  void set_biases(const std::vector<torch::Tensor>& biases, int64_t act, double alpha, double limit);

  torch::Tensor router_, bias_, gate_, up_, down_, shared_gate_;
  torch::Tensor router_bias_, gate_bias_, up_bias_, down_bias_;
  ExpertEpilogue epilogue_;
  int64_t qtypes_[3];
  int64_t E_, H_, I_;
  RoutingKnobs knobs_;
  std::vector<QPart> shared_gate_up_, shared_down_;
};

}  // namespace wsq
