// DecodeStack (decode_stack.h): the program read once, then run op by op on the kernels the Python
// modules call.
#include "decode_stack.h"

#include <algorithm>

#include "attention.h"
#include "qlinear.h"
#include "rowops.h"
#include "team.h"

namespace wsq {

namespace {

// Reads the program's ints in order, each read checked against the program's end.
struct Reader {
  const std::vector<int64_t>& p;
  size_t at = 0;
  int64_t next() {
    TORCH_CHECK(at < p.size(), "DecodeStack: the program ends inside an op");
    return p[at++];
  }
};

}  // namespace

DecodeStack::DecodeStack(std::vector<int64_t> program, std::vector<torch::Tensor> tensors, std::vector<double> floats,
                         std::vector<std::shared_ptr<MoeLayer>> moes)
    : tensors_(std::move(tensors)), moes_(std::move(moes)) {
  Reader r{program};
  const auto tensor = [&] {
    const int64_t i = r.next();
    TORCH_CHECK(i >= 0 && i < int64_t(tensors_.size()), "DecodeStack: tensor index ", i, " out of range");
    return i;
  };
  const auto number = [&] {
    const int64_t i = r.next();
    TORCH_CHECK(i >= 0 && i < int64_t(floats.size()), "DecodeStack: float index ", i, " out of range");
    return floats[i];
  };
  while (r.at < program.size()) {
    StackStep s;
    s.op = r.next();
    switch (s.op) {
      case kNorm:
        s.t = {tensor()};
        s.f = number();
        break;
      case kLinear: {
        const int64_t parts = r.next();
        TORCH_CHECK(parts >= 1, "DecodeStack: a projection has at least one part");
        s.bias = r.next();
        TORCH_CHECK(s.bias < int64_t(tensors_.size()), "DecodeStack: bias index ", s.bias, " out of range");
        if (s.bias < 0) s.bias = -1;
        s.lora = r.next();
        for (int64_t k = 0; k < parts; ++k) {
          const int64_t t = tensor(), qtype = r.next(), n = r.next();
          s.parts.push_back({tensors_[t], qtype, n});
        }
        break;
      }
      case kAttention: {
        s.t = {tensor(), tensor()};
        s.a = r.next();
        s.f = number();
        s.var.window = r.next();
        s.var.softcap = number();
        const int64_t sinks = r.next();
        s.b = r.next();
        TORCH_CHECK(s.b >= 0, "DecodeStack: a rotary table index must not be negative");
        TORCH_CHECK(s.var.window >= 0 && s.var.softcap >= 0.0, "DecodeStack: window and softcap must not be negative");
        TORCH_CHECK(sinks < int64_t(tensors_.size()), "DecodeStack: sinks index ", sinks, " out of range");
        if (sinks >= 0) {
          const torch::Tensor& t = tensors_[sinks];
          TORCH_CHECK(t.dim() == 1 && t.size(0) == s.a && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                      "DecodeStack: sinks must be float32 [num_heads]");
          s.var.sinks = t;
        }
        s.c = r.next();
        TORCH_CHECK(s.c >= 0, "DecodeStack: KV group ", s.c, " out of range");
        num_groups_ = std::max(num_groups_, s.c + 1);
        break;
      }
      case kSiluMul:
      case kGeluMul:
        break;
      case kRmsNorm:
        s.t = {tensor()};
        s.f = number();
        break;
      case kScale:
        s.f = number();
        break;
      case kQkNorm:
        s.t = {tensor(), tensor()};
        s.f = number();
        s.a = r.next();
        s.b = r.next();
        TORCH_CHECK(s.a % tensors_[s.t[0]].numel() == 0 && s.b % tensors_[s.t[1]].numel() == 0,
                    "DecodeStack: QK-norm weights must divide the q and k widths");
        break;
      case kMoe:
        s.a = r.next();
        TORCH_CHECK(s.a >= 0 && s.a < int64_t(moes_.size()) && moes_[s.a], "DecodeStack: MoE layer ", s.a, " out of range");
        break;
      default:
        TORCH_CHECK(false, "DecodeStack: unknown op ", s.op);
    }
    steps_.push_back(std::move(s));
  }
}

std::vector<torch::Tensor> DecodeStack::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                torch::Tensor slots, torch::Tensor tables, torch::Tensor lens,
                                                int64_t isa, const LoraList& lora,
                                                const std::vector<torch::Tensor>& lora_rows) {
  std::vector<torch::Tensor> group_slots, group_tables;  // per KV group
  if (slots.dim() == 2) {
    TORCH_CHECK(tables.dim() == 3 && tables.size(0) == slots.size(0),
                "DecodeStack: per-group slots [G, n] and tables [G, n, w] must agree");
    for (int64_t g = 0; g < slots.size(0); ++g) {
      group_slots.push_back(slots[g]);
      group_tables.push_back(tables[g]);
    }
  } else {
    group_slots.push_back(slots);
    group_tables.push_back(tables);
  }
  TORCH_CHECK(int64_t(group_slots.size()) >= num_groups_, "DecodeStack: the program reads ", num_groups_,
              " KV groups, the step has ", group_slots.size());
  torch::Tensor residual;
  const StackInputs in{cos, sin, group_slots, group_tables, lens, isa, lora, lora_rows};
  run_as_team([&] { run(x, residual, in); });
  return {x, residual};
}

void DecodeStack::run(torch::Tensor& x, torch::Tensor& residual, const StackInputs& in) {
  for (const StackStep& s : steps_) {
    switch (s.op) {
      case kNorm:
        if (!residual.defined()) {
          residual = x;
          x = add_rms_norm(x, c10::nullopt, tensors_[s.t[0]], s.f, in.isa)[0];
        } else {
          auto r = add_rms_norm(x, residual, tensors_[s.t[0]], s.f, in.isa);
          x = r[0];
          residual = r[1];
        }
        break;
      case kLinear:
        x = linear(s, x, in);
        break;
      case kAttention: {
        const int64_t n = x.size(0);
        TORCH_CHECK(in.cos.size(0) >= (s.b + 1) * n && in.sin.size(0) == in.cos.size(0),
                    "DecodeStack: no rotary table ", s.b, " among the step's cos and sin rows");
        x = rope_store_decode_v(x, in.cos.narrow(0, s.b * n, n), in.sin.narrow(0, s.b * n, n), tensors_[s.t[0]],
                                tensors_[s.t[1]], in.slots[s.c], s.a, in.tables[s.c], in.lens, s.f, in.isa, s.var);
        break;
      }
      case kSiluMul:
        x = silu_mul(x, in.isa);
        break;
      case kGeluMul: {
        const int64_t d = x.size(1) / 2;
        x = at::gelu(x.narrow(1, 0, d), "tanh").mul_(x.narrow(1, d, d));
        break;
      }
      case kRmsNorm:
        x = add_rms_norm(x, c10::nullopt, tensors_[s.t[0]], s.f, in.isa)[0];
        break;
      case kScale:
        x.mul_(s.f);
        break;
      case kQkNorm:
        qk_norm(s, x, in.isa);
        break;
      case kMoe:
        x = moes_[s.a]->forward(x, in.isa);
        break;
    }
  }
}

torch::Tensor DecodeStack::linear(const StackStep& s, const torch::Tensor& x, const StackInputs& in) {
  c10::optional<torch::Tensor> bias;
  if (s.bias >= 0) bias = tensors_[s.bias];
  auto y = project(x, s.parts, bias, in.isa);
  if (s.lora >= 0 && !in.lora.empty()) lora_apply(y, x, s.lora, in.lora, in.lora_rows, in.isa);
  return y;
}

// As Attention._norm_qk: each part's rows (a head's values, or the whole part) as one contiguous
// matrix through add_rms_norm, written back in place.
void DecodeStack::qk_norm(const StackStep& s, torch::Tensor& x, int64_t isa) {
  const int64_t t = x.size(0);
  const int64_t starts[2] = {0, s.a}, sizes[2] = {s.a, s.b};
  for (int i = 0; i < 2; ++i) {
    const torch::Tensor& w = tensors_[s.t[i]];
    auto part = x.narrow(1, starts[i], sizes[i]);
    auto rows = part.reshape({-1, w.numel()}).contiguous();
    part.copy_(add_rms_norm(rows, c10::nullopt, w, s.f, isa)[0].view({t, sizes[i]}));
  }
}

}  // namespace wsq
