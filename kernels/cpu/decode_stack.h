// A decode-only step's layers over quantized weights in one call (kernels/decode_stack.py writes the
// program). The model describes its layers as a flat program of ops, each calling the kernel the
// Python module calls, in the module's order, so the same bits; what goes is the Python and pybind
// between them (~8 calls a layer, a few microseconds each: a tenth of a batch-1 step of a small model).
// Nothing here knows a family's layer order.
//
// The program: ints, each op its code then its arguments; tensors and floats by index.
//   kNorm       w eps                     x, residual = add_rms_norm(x, residual) (none yet: residual = x)
//   kLinear     parts bias lora (t qtype n)*parts   x = x @ W^T (+ bias) (+ the adapters' deltas of key lora)
//   kAttention  k v heads scale window softcap sinks rope group   x = rope_store_decode(x): rotary (by
//                                         the step's table `rope`: rows [rope * n, (rope + 1) * n) of cos
//                                         and sin), KV store, paged attention with the layer's variant
//                                         (attention.h; sinks -1: none) over its KV group's slots and block
//                                         tables (group: their index; a model of layers of several windows,
//                                         engine/kv_groups.py)
//   kSiluMul                              x = silu(gate) * up
//   kGeluMul                              x = gelu_tanh(gate) * up (GeGLU: ATen's gelu, as the torch op)
//   kRmsNorm    w eps                     x = rms_norm(x), the residual untouched (Gemma's sandwich norms)
//   kScale      m                         x = x * m
//   kQkNorm     qw kw eps q_size kv_size  x's q and k parts RMS-normed in place, rows of qw's (kw's) width
//   kMoe        layer                     x = the mixture of experts (moe_layer.h: MoeLayer.forward)
#pragma once

#include <torch/extension.h>

#include <memory>
#include <vector>

#include "attention.h"
#include "lora_weights.h"
#include "moe_layer.h"
#include "qlinear.h"

namespace wsq {

enum StackOp : int64_t {
  kNorm = 0,
  kLinear = 1,
  kAttention = 2,
  kSiluMul = 3,
  kScale = 4,
  kQkNorm = 5,
  kMoe = 6,
  kGeluMul = 7,
  kRmsNorm = 8
};

struct StackStep {
  int64_t op = 0;
  std::vector<int64_t> t;        // tensors it reads
  std::vector<QPart> parts;       // kLinear: its parts
  int64_t bias = -1, lora = -1;   // kLinear: the bias tensor (-1: none), the LoRA key (-1: none)
  int64_t a = 0, b = 0, c = 0;    // kAttention: heads, rope table, KV group; kQkNorm: q_size, kv_size; kMoe: the layer
  double f = 0;                     // eps, scale or multiplier
  AttnVariant var;                  // kAttention: window, softcap, sinks
};

// The step's per-row inputs, shared by every attention op: per KV group its slots and block tables.
struct StackInputs {
  const torch::Tensor &cos, &sin;
  const std::vector<torch::Tensor>&slots, &tables;
  const torch::Tensor& lens;
  int64_t isa;
  const LoraList& lora;
  const std::vector<torch::Tensor>& lora_rows;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<int64_t> program, std::vector<torch::Tensor> tensors, std::vector<double> floats,
              std::vector<std::shared_ptr<MoeLayer>> moes);

  int64_t num_steps() const { return int64_t(steps_.size()); }

  // x [n, hidden] (the embeddings) -> (the last op's x, the residual), as the layers' loop in
  // CausalLM.forward leaves them for the final norm. cos, sin: [tables * n, 1, head_dim], each
  // rotary table's n rows after the last's (CpuAttentionPlan.rotary). `slots` [n] and `tables` [n, w],
  // or [G, n] and [G, n, w]: one of each per KV group. `lora`, `lora_rows`: the step's adapters and
  // their rows (lora_weights.h).
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                     torch::Tensor tables, torch::Tensor lens, int64_t isa, const LoraList& lora,
                                     const std::vector<torch::Tensor>& lora_rows);

 private:
  // the program, on the calling thread's team (team.h): one OpenMP region for the whole stack
  void run(torch::Tensor& x, torch::Tensor& residual, const StackInputs& in);
  // QuantLinear.forward, or SplitLinear.forward (the parts side by side, then + bias), then the adapters
  torch::Tensor linear(const StackStep& s, const torch::Tensor& x, const StackInputs& in);
  void qk_norm(const StackStep& s, torch::Tensor& x, int64_t isa);

  std::vector<StackStep> steps_;
  int64_t num_groups_ = 1;  // the KV groups its attention ops read
  std::vector<torch::Tensor> tensors_;
  std::vector<std::shared_ptr<MoeLayer>> moes_;
};

}  // namespace wsq
