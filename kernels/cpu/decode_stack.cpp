// DecodeStack (decode_stack.h): the same kernels the Python layers call, one after another.
#include "decode_stack.h"

#include "attention.h"
#include "qlinear.h"
#include "rowops.h"
#include "team.h"

namespace wsq {

DecodeStack::DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> packed,
                         std::vector<int64_t> qtypes, std::vector<int64_t> ns, std::vector<int64_t> parts,
                         std::vector<torch::Tensor> qkv_bias, std::vector<torch::Tensor> caches, int64_t num_heads,
                         double eps, double scale)
    : norms_(std::move(norms)),
      packed_(std::move(packed)),
      qtypes_(std::move(qtypes)),
      ns_(std::move(ns)),
      parts_(std::move(parts)),
      caches_(std::move(caches)),
      num_heads_(num_heads),
      eps_(eps),
      scale_(scale) {
  layers_ = int64_t(norms_.size()) / 2;
  TORCH_CHECK(int64_t(norms_.size()) == 2 * layers_ && int64_t(parts_.size()) == 4 * layers_ &&
                  int64_t(qkv_bias.size()) == layers_ && int64_t(caches_.size()) == 2 * layers_,
              "DecodeStack: 2 norms, 4 projections, 1 qkv bias and 2 caches per layer");
  int64_t at = 0;
  for (int64_t k : parts_) {
    TORCH_CHECK(k >= 1, "DecodeStack: a projection has at least one part");
    first_.push_back(at);
    at += k;
  }
  TORCH_CHECK(int64_t(packed_.size()) == at && int64_t(qtypes_.size()) == at && int64_t(ns_.size()) == at,
              "DecodeStack: one packed weight, qtype and width per part");
  for (auto& b : qkv_bias) {
    if (b.numel())
      bias_.emplace_back(b);
    else
      bias_.emplace_back(c10::nullopt);
  }
  attn_.resize(layers_);
  scales_.assign(layers_, scale_);
}

void DecodeStack::set_attention(int64_t layer, int64_t window, double softcap, c10::optional<torch::Tensor> sinks,
                                double scale) {
  TORCH_CHECK(layer >= 0 && layer < layers_, "DecodeStack: layer ", layer, " out of range");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "DecodeStack: window and softcap must not be negative");
  if (sinks.has_value())
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads_ && sinks->scalar_type() == torch::kFloat32,
                "DecodeStack: sinks must be float32 [num_heads]");
  attn_[layer] = AttnVariant{window, softcap, sinks.has_value() ? c10::optional<torch::Tensor>(sinks->contiguous())
                                                                : c10::nullopt};
  scales_[layer] = scale;
}

std::vector<torch::Tensor> DecodeStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
                                                int64_t isa, const LoraList& lora,
                                                const std::vector<torch::Tensor>& lora_rows) {
  torch::Tensor residual;
  run_as_team([&] { layers(x, residual, cos, sin, slots, tables, lens, isa, lora, lora_rows); });
  return {x, residual};
}

void DecodeStack::layers(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& cos,
                         const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& tables,
                         const torch::Tensor& lens, int64_t isa, const LoraList& lora,
                         const std::vector<torch::Tensor>& lora_rows) {
  for (int64_t l = 0; l < layers_; ++l) {
    torch::Tensor h;
    if (l == 0) {
      residual = x;
      h = add_rms_norm(x, c10::nullopt, norms_[2 * l], eps_, isa)[0];
    } else {
      auto r = add_rms_norm(x, residual, norms_[2 * l], eps_, isa);
      h = r[0];
      residual = r[1];
    }
    const int64_t p = 4 * l;
    auto qkv = project(h, p, bias_[l], isa, lora, lora_rows);
    auto o = rope_store_decode_v(qkv, cos, sin, caches_[2 * l], caches_[2 * l + 1], slots, num_heads_, tables, lens,
                                 scales_[l], isa, attn_[l]);
    auto r = add_rms_norm(project(o, p + 1, c10::nullopt, isa, lora, lora_rows), residual, norms_[2 * l + 1], eps_,
                          isa);
    residual = r[1];
    auto gate_up = project(r[0], p + 2, c10::nullopt, isa, lora, lora_rows);
    x = project(silu_mul(gate_up, isa), p + 3, c10::nullopt, isa, lora, lora_rows);
  }
}

torch::Tensor DecodeStack::project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias,
                                   int64_t isa, const LoraList& lora, const std::vector<torch::Tensor>& rows) {
  auto y = base_project(x, p, bias, isa);
  if (!lora.empty()) lora_apply(y, x, p, lora, rows, isa);
  return y;
}

torch::Tensor DecodeStack::base_project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias,
                                        int64_t isa) {
  const int64_t i = first_[p];
  if (parts_[p] == 1) return qlinear(x, packed_[i], qtypes_[i], ns_[i], bias, isa, false);
  std::vector<torch::Tensor> ys;
  for (int64_t k = i; k < i + parts_[p]; ++k)
    ys.push_back(qlinear(x, packed_[k], qtypes_[k], ns_[k], c10::nullopt, isa, false));
  auto y = torch::cat(ys, -1);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace wsq
