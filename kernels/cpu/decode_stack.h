// The decode layers of a model over quantized weights in one call (kernels/cpu_ops.py: decode_stack):
// per layer the calls wsllm/models/llama.py's DecoderLayer makes one by one (add_rms_norm, the
// qkv matmul, rope_store_decode, o, add_rms_norm, gate/up, silu_mul, down), in the same order on
// the same kernels, so the same bits; what goes is the Python and pybind between them (~8 calls
// a layer, a few microseconds each: a tenth of a batch-1 step of a small model).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "attention.h"
#include "lora_weights.h"

namespace wsq {

class DecodeStack {
 public:
  // per layer: norms (input, post-attention); the projections qkv, o, gate_up, down, each in
  // `parts` pieces (1, or a split projection's formats: SplitLinear), whose packed weights,
  // qtypes and output widths ns follow in order; qkv_bias (an empty tensor: none); caches (k, v).
  DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> packed, std::vector<int64_t> qtypes,
              std::vector<int64_t> ns, std::vector<int64_t> parts, std::vector<torch::Tensor> qkv_bias,
              std::vector<torch::Tensor> caches, int64_t num_heads, double eps, double scale);

  int64_t num_layers() const { return layers_; }

  // Layer `layer`'s attention variant (attention.h) and scale; by default none, and the stack's scale.
  void set_attention(int64_t layer, int64_t window, double softcap, c10::optional<torch::Tensor> sinks,
                     double scale);

  // x [n, hidden] (the embeddings) -> (the last layer's output, its residual), as the layers'
  // loop in LlamaForCausalLM.forward leaves them for the final norm. `lora`, `lora_rows`: the
  // step's adapters and their rows (lora_weights.h), added after each projection as the Python
  // layers add them.
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                     torch::Tensor tables, torch::Tensor lens, int64_t isa, const LoraList& lora,
                                     const std::vector<torch::Tensor>& lora_rows);

 private:
  // the layers, on the calling thread's team (team.h): one OpenMP region for the whole stack
  void layers(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& cos, const torch::Tensor& sin,
              const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens, int64_t isa,
              const LoraList& lora, const std::vector<torch::Tensor>& lora_rows);
  // the projection, and the step's adapters' deltas on their rows (none: nothing more)
  torch::Tensor project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias, int64_t isa,
                        const LoraList& lora, const std::vector<torch::Tensor>& rows);
  // QuantLinear.forward, or SplitLinear.forward (the parts side by side, then + bias)
  torch::Tensor base_project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias,
                             int64_t isa);

  std::vector<torch::Tensor> norms_, packed_;
  std::vector<int64_t> qtypes_, ns_, parts_, first_;
  std::vector<c10::optional<torch::Tensor>> bias_;
  std::vector<torch::Tensor> caches_;
  std::vector<AttnVariant> attn_;  // per layer (set_attention)
  std::vector<double> scales_;
  int64_t num_heads_, layers_ = 0;
  double eps_, scale_;
};

}  // namespace wsq
