// The torch side of the LoRA pass (lora.cpp): an adapter's pieces held once (LoraWeights, made by
// kernels/lora.py: NativeLora) and the grouped pass over a projection's output, which the decode
// stack (qgemm.cpp) calls after each projection and Python calls layer by layer.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <vector>

#include "lora.h"

namespace wsq {

// One adapter: per projection key (layer * 4 + slot: qkv, o, gate_up, down) its pieces.
class LoraWeights {
 public:
  LoraWeights(std::vector<int64_t> keys, std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt,
              std::vector<int64_t> offsets);
  const std::vector<LoraPiece>& at(int64_t key) const {
    static const std::vector<LoraPiece> none;
    return key >= 0 && key < int64_t(by_key_.size()) ? by_key_[key] : none;
  }
  int64_t num_pieces() const { return int64_t(held_.size() / 2); }

 private:
  std::vector<torch::Tensor> held_;  // the tensors the pieces point into
  std::vector<std::vector<LoraPiece>> by_key_;
};

using LoraList = std::vector<std::shared_ptr<LoraWeights>>;

// y [M, N] += for each group g, on rows[g] (int64; empty: every row) of x [M, K], adapter g's
// pieces of projection `key`. x and y: contiguous CPU float32 or bfloat16, the same type.
void lora_apply(torch::Tensor y, const torch::Tensor& x, int64_t key, const LoraList& adapters,
                const std::vector<torch::Tensor>& rows, int64_t isa);

void register_lora(pybind11::module& m);  // the pybind names of lora.cpp, from qgemm.cpp's module

}  // namespace wsq
