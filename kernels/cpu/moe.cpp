// MoeLayer (moe_layer.h): routing, the grouped pass over the chosen experts, the shared expert.
#include "moe_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fvec.h"
#include "isa.h"
#include "qgemm.h"
#include "rowops.h"
#include "team.h"

namespace wsq {

namespace {

void silu_scalar(const void* xv, void* outv, int64_t m0, int64_t m1, int64_t d) {
  const float* x = static_cast<const float*>(xv);
  float* out = static_cast<float*>(outv);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t j = 0; j < d; ++j) {
      const float a = x[m * 2 * d + j];
      out[m * d + j] = (a / (1.0f + std::exp(-a))) * x[m * 2 * d + d + j];
    }
}

// One projection of every expert: E experts' packed rows one expert after another.
struct ExpertMat {
  const uint8_t* w;
  int qtype;
  int64_t groups;      // groups of kRows rows per expert
  size_t group_bytes;
  GroupFn fn;
  const uint8_t* group(int64_t e, int64_t g) const { return w + size_t(e * groups + g) * group_bytes; }
};

ExpertMat mat(const torch::Tensor& packed, int64_t qtype, int64_t E, int64_t isa) {
  return {packed.data_ptr<uint8_t>(), int(qtype), packed.size(0) / E, size_t(packed.size(1) * packed.size(2)),
          group_kernel(isa, int(qtype))};
}

// A pass's (row, expert) pairs sorted by expert, stably: expert e's are [off[e], off[e + 1]).
struct Sorted {
  std::vector<int64_t> off, row, pair, active;
  std::vector<float> weight;
};

Sorted sort_pairs(const int32_t* ids, const float* w, int64_t T, int64_t k, int64_t E) {
  Sorted s;
  s.off.assign(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) ++s.off[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) {
    if (s.off[e + 1] > 0) s.active.push_back(e);
    s.off[e + 1] += s.off[e];
  }
  s.row.resize(T * k);
  s.pair.resize(T * k);
  s.weight.resize(T * k);
  std::vector<int64_t> at(s.off.begin(), s.off.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t i = at[ids[p]]++;
    s.row[i] = p / k;
    s.pair[i] = p;
    s.weight[i] = w[p];
  }
  return s;
}

// Quantized rows of `from` in the order `row` gives (a pair's copy of its row's blocks).
void gather(const ActRows& from, const std::vector<int64_t>& row, ActRows& to) {
  const int64_t nb = from.K / from.bv, n16 = from.K / 16, n32 = from.K / 32;
  parallel_for(0, int64_t(row.size()), 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = row[i];
      std::memcpy(to.q.get() + i * from.K, from.q.get() + r * from.K, size_t(from.K));
      std::memcpy(to.d.get() + i * nb, from.d.get() + r * nb, sizeof(float) * nb);
      std::memcpy(to.s16.get() + i * n16, from.s16.get() + r * n16, sizeof(int32_t) * n16);
      if (from.s16p) std::memcpy(to.s16p.get() + i * n32, from.s16p.get() + r * n32, sizeof(int32_t) * n32);
    }
  });
}

// A chunk must outweigh its claim and its call: ~64K multiply-adds of the item's rows.
int64_t grain_for(int64_t per_item) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(per_item, 1)); }

// multiply-adds of one item of a pass: a group of kRows rows over K values, for the pass's mean rows
// per chosen expert
int64_t item_work(int64_t K, const Sorted& s) {
  const int64_t experts = std::max<int64_t>(1, int64_t(s.active.size()));
  return kRows * K * std::max<int64_t>(1, int64_t(s.row.size()) / experts);
}

// Expert e's biases on one group of kRows rows (g), added to mt rows of a tile [mt, kRows].
void add_bias(const float* bias, int64_t e, int64_t rows, int64_t g, int mt, float* tile) {
  if (!bias) return;
  const float* b = bias + e * rows + g * kRows;
  for (int r = 0; r < mt; ++r)
    for (int c = 0; c < kRows; ++c) tile[r * kRows + c] += b[c];
}

// h [P, I] float32 (sorted pairs) = act(x . gate_e + gate bias, x . up_e + up bias) for each pair's
// expert e (act: silu(gate) * up, or the epilogue's clamped SwiGLU, element by element).
void gate_up_pass(const ExpertMat& gate, const ExpertMat& up, const ActRows& gx, const ActRows& ux,
                  const Sorted& s, int64_t I, SiluFn silu, const ExpertEpilogue& ep, float* h) {
  const int64_t G = gate.groups, items = int64_t(s.active.size()) * G;
  parallel_for(0, items, grain_for(2 * item_work(gx.K, s)), [&](int64_t i0, int64_t i1) {
    float tg[kMaxTile * kRows], tu[kMaxTile * kRows], gu[kMaxTile * 2 * kRows], hv[kMaxTile * kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = s.active[i / G], g = i % G, first = s.off[e], n = s.off[e + 1] - first;
      const Act ga = gx.view(first), ua = ux.view(first);  // m0 counts from the expert's first pair
      for (int64_t m0 = 0; m0 < n; m0 += kMaxTile) {
        const int mt = int(std::min<int64_t>(kMaxTile, n - m0));
        gate.fn(gate.group(e, g), ga, int(m0), mt, tg);
        up.fn(up.group(e, g), ua, int(m0), mt, tu);
        add_bias(ep.gate_bias, e, I, g, mt, tg);
        add_bias(ep.up_bias, e, I, g, mt, tu);
        if (ep.act == kSwigluOai) {
          for (int j = 0; j < mt * kRows; ++j) hv[j] = swiglu_oai(tg[j], tu[j], ep.alpha, ep.limit);
        } else {
          for (int r = 0; r < mt; ++r) {
            std::memcpy(gu + r * 2 * kRows, tg + r * kRows, sizeof(float) * kRows);
            std::memcpy(gu + r * 2 * kRows + kRows, tu + r * kRows, sizeof(float) * kRows);
          }
          silu(gu, hv, 0, mt, kRows);
        }
        for (int r = 0; r < mt; ++r)
          std::memcpy(h + (first + m0 + r) * I + g * kRows, hv + r * kRows, sizeof(float) * kRows);
      }
    }
  });
}

// y[pair] [H] = weight * (h_pair . down_e + down bias) for each sorted pair (its expert e), into the
// pair's row.
void down_pass(const ExpertMat& down, const ActRows& hx, const Sorted& s, int64_t H, const float* bias, float* y) {
  const int64_t G = down.groups, items = int64_t(s.active.size()) * G;
  parallel_for(0, items, grain_for(item_work(hx.K, s)), [&](int64_t i0, int64_t i1) {
    float tile[kMaxTile * kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = s.active[i / G], g = i % G, first = s.off[e], n = s.off[e + 1] - first;
      const Act a = hx.view(first);
      for (int64_t m0 = 0; m0 < n; m0 += kMaxTile) {
        const int mt = int(std::min<int64_t>(kMaxTile, n - m0));
        down.fn(down.group(e, g), a, int(m0), mt, tile);
        add_bias(bias, e, H, g, mt, tile);
        for (int r = 0; r < mt; ++r) {
          const int64_t p = first + m0 + r;
          const float w = s.weight[p];
          float* o = y + s.pair[p] * H + g * kRows;
          for (int c = 0; c < kRows; ++c) o[c] = w * tile[r * kRows + c];
        }
      }
    }
  });
}

// Buffers a pass reuses (grow-only, per calling thread): a fresh mapping of a few MB at every layer
// of every step would be page faults.
struct Scratch {
  ActRows x, gx, ux, hx, x2;
  std::vector<float> h, y, logits, xf;
};
thread_local Scratch tl_scratch;

void fit(ActRows& a, int64_t rows, int K, int bv, bool pairs) {
  if (!a.q || a.M < rows || a.K != K || a.bv != bv || bool(a.s16p) != pairs) a.alloc(rows, K, bv, pairs);
}


void check_rows(const torch::Tensor& x, int64_t H) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && x.size(1) == H,
              "x must be a contiguous float32 or bfloat16 CPU matrix [T, ", H, "]");
}

}  // namespace

MoeLayer::MoeLayer(torch::Tensor router, torch::Tensor selection_bias, std::vector<torch::Tensor> experts,
                   std::vector<int64_t> qtypes, int64_t top_k, int64_t gating, bool renormalize, double scale,
                   std::vector<torch::Tensor> shared, std::vector<int64_t> shared_qtypes,
                   std::vector<int64_t> shared_ns, int64_t shared_gate_up, torch::Tensor shared_gate,
                   std::vector<torch::Tensor> biases, int64_t act, double alpha, double limit) {
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == torch::kFloat32 && router.is_contiguous(),
              "MoeLayer: the router must be a contiguous float32 [E, H]");
  router_ = router;
  E_ = router.size(0);
  H_ = router.size(1);
  TORCH_CHECK(experts.size() == 3 && qtypes.size() == 3, "MoeLayer: gate, up and down experts");
  for (int i = 0; i < 3; ++i) {
    const torch::Tensor& p = experts[i];
    TORCH_CHECK(qtypes[i] >= 0 && qtypes[i] < kNumQTypes, "MoeLayer: unknown quantization type id ", qtypes[i]);
    TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kUInt8 && p.is_contiguous() &&
                    p.size(2) == packed_bytes(int(qtypes[i])) && p.size(0) % E_ == 0,
                "MoeLayer: expert weights must be contiguous uint8 [E * groups, blocks, bytes]");
    qtypes_[i] = qtypes[i];
  }
  gate_ = experts[0];
  up_ = experts[1];
  down_ = experts[2];
  I_ = gate_.size(0) / E_ * kRows;
  TORCH_CHECK(up_.size(0) == gate_.size(0), "MoeLayer: gate and up experts differ in their rows");
  TORCH_CHECK(gate_.size(1) * block_values(int(qtypes_[0])) == H_ && up_.size(1) * block_values(int(qtypes_[1])) == H_,
              "MoeLayer: gate and up experts do not take the router's width");
  TORCH_CHECK(down_.size(0) / E_ * kRows == H_ && down_.size(1) * block_values(int(qtypes_[2])) == I_,
              "MoeLayer: down experts do not map I = ", I_, " back to H = ", H_);
  TORCH_CHECK(top_k >= 1 && top_k <= E_, "MoeLayer: top_k ", top_k, " of ", E_, " experts");
  TORCH_CHECK(gating >= kSoftmax && gating <= kSoftmaxTopk, "MoeLayer: unknown gating ", gating);
  if (selection_bias.numel()) {
    TORCH_CHECK(selection_bias.numel() == E_ && selection_bias.scalar_type() == torch::kFloat32 &&
                    selection_bias.is_contiguous(),
                "MoeLayer: the selection bias must be a contiguous float32 [E]");
    bias_ = selection_bias;
  }
  knobs_ = {E_, top_k, gating, renormalize, float(scale), bias_.defined() ? bias_.data_ptr<float>() : nullptr};
  TORCH_CHECK(shared.size() == shared_qtypes.size() && shared.size() == shared_ns.size() &&
                  shared_gate_up >= 0 && shared_gate_up <= int64_t(shared.size()),
              "MoeLayer: one qtype and width per shared part");
  for (size_t i = 0; i < shared.size(); ++i)
    (int64_t(i) < shared_gate_up ? shared_gate_up_ : shared_down_).push_back({shared[i], shared_qtypes[i], shared_ns[i]});
  TORCH_CHECK(shared_gate_up_.empty() == shared_down_.empty(), "MoeLayer: a shared expert has gate_up and down");
  if (shared_gate.numel()) {
    TORCH_CHECK(!shared_down_.empty() && shared_gate.numel() == H_ && shared_gate.scalar_type() == torch::kFloat32,
                "MoeLayer: the shared gate must be float32 [H] beside a shared expert");
    shared_gate_ = shared_gate.contiguous();
  }
  set_biases(biases, act, alpha, limit);
}

void MoeLayer::set_biases(const std::vector<torch::Tensor>& biases, int64_t act, double alpha, double limit) {
  TORCH_CHECK(biases.empty() || biases.size() == 4, "MoeLayer: the router's, gate's, up's and down's biases");
  TORCH_CHECK(act == kSilu || act == kSwigluOai, "MoeLayer: unknown expert activation ", act);
  torch::Tensor* slots[4] = {&router_bias_, &gate_bias_, &up_bias_, &down_bias_};
  const int64_t sizes[4] = {E_, E_ * I_, E_ * I_, E_ * H_};
  for (size_t i = 0; i < biases.size(); ++i) {
    if (!biases[i].numel()) continue;
    TORCH_CHECK(biases[i].scalar_type() == torch::kFloat32 && biases[i].is_contiguous() &&
                    biases[i].numel() == sizes[i],
                "MoeLayer: bias ", i, " must be a contiguous float32 of ", sizes[i], " values");
    *slots[i] = biases[i];
  }
  auto ptr = [](const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  epilogue_ = {ptr(gate_bias_), ptr(up_bias_), ptr(down_bias_), act, float(alpha), float(limit)};
}

void MoeLayer::route_rows(const float* x, int64_t T, int64_t isa, int32_t* ids, float* weights) const {
  Scratch& sc = tl_scratch;
  sc.logits.resize(size_t(T * E_));
  const RouterFn fn = isa == kAvx512Vnni ? router_logits_avx512() : isa == kAvx2 ? router_logits_avx2()
                                                                                 : router_logits_scalar();
  const float* w = router_.data_ptr<float>();
  float* logits = sc.logits.data();
  parallel_for(0, E_, grain_for(T * H_), [&](int64_t e0, int64_t e1) { fn(x, w, T, e0, e1, H_, E_, logits); });
  const int64_t k = knobs_.top_k;
  parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(3 * E_);
    const float* rb = router_bias_.defined() ? router_bias_.data_ptr<float>() : nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      if (rb)
        for (int64_t e = 0; e < E_; ++e) logits[t * E_ + e] += rb[e];
      route_row(knobs_, logits + t * E_, scratch.data(), ids + t * k, weights + t * k);
    }
  });
}

// out [T, H] float32 = the routed experts' sum for rows x [T, H] (T <= kMoeChunkRows)
void MoeLayer::grouped(const void* x, bool bf16, int64_t T, const int32_t* ids, const float* weights, int64_t isa,
                       float* out) const {
  Scratch& sc = tl_scratch;
  const int64_t k = knobs_.top_k, P = T * k;
  const Sorted s = sort_pairs(ids, weights, T, k, E_);
  const ExpertMat gate = mat(gate_, qtypes_[0], E_, isa), up = mat(up_, qtypes_[1], E_, isa),
                  down = mat(down_, qtypes_[2], E_, isa);
  const int gbv = block_values(gate.qtype), ubv = block_values(up.qtype), dbv = block_values(down.qtype);
  // x quantized once for gate (and once more only where up's blocks are of another size)
  fit(sc.x, T, int(H_), gbv, gate.qtype == Q6_K || up.qtype == Q6_K);
  parallel_for(0, T, 8, [&](int64_t m0, int64_t m1) { quantize_act(x, bf16, m0, m1, isa, sc.x); });
  fit(sc.gx, P, int(H_), gbv, bool(sc.x.s16p));
  gather(sc.x, s.row, sc.gx);
  const ActRows* ux = &sc.gx;
  if (ubv != gbv) {
    fit(sc.x2, T, int(H_), ubv, up.qtype == Q6_K);
    parallel_for(0, T, 8, [&](int64_t m0, int64_t m1) { quantize_act(x, bf16, m0, m1, isa, sc.x2); });
    fit(sc.ux, P, int(H_), ubv, bool(sc.x2.s16p));
    gather(sc.x2, s.row, sc.ux);
    ux = &sc.ux;
  }
  const SiluFn silu = isa == kAvx512Vnni ? silu_mul_avx512(false) : isa == kAvx2 ? silu_mul_avx2(false) : silu_scalar;
  sc.h.resize(size_t(P * I_));
  gate_up_pass(gate, up, sc.gx, *ux, s, I_, silu, epilogue_, sc.h.data());
  fit(sc.hx, P, int(I_), dbv, down.qtype == Q6_K);
  parallel_for(0, P, 8, [&](int64_t m0, int64_t m1) { quantize_act(sc.h.data(), false, m0, m1, isa, sc.hx); });
  sc.y.resize(size_t(P * H_));
  float* y = sc.y.data();
  down_pass(down, sc.hx, s, H_, epilogue_.down_bias, y);
  const int64_t H = H_;
  parallel_for(0, T, grain_for(k * H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * H;
      std::memcpy(o, y + t * k * H, sizeof(float) * H);
      for (int64_t j = 1; j < k; ++j) {
        const float* yj = y + (t * k + j) * H;
        for (int64_t c = 0; c < H; ++c) o[c] = o[c] + yj[c];
      }
    }
  });
}

std::vector<torch::Tensor> MoeLayer::route(const torch::Tensor& x, int64_t isa) const {
  check_rows(x, H_);
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the requested kernel path");
  const int64_t T = x.size(0), k = knobs_.top_k;
  auto xf = x.to(torch::kFloat32).contiguous();
  auto ids = torch::empty({T, k}, torch::kInt32);
  auto w = torch::empty({T, k}, torch::kFloat32);
  run_as_team([&] { route_rows(xf.data_ptr<float>(), T, isa, ids.data_ptr<int32_t>(), w.data_ptr<float>()); });
  return {ids, w};
}

torch::Tensor MoeLayer::experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                                int64_t isa) const {
  check_rows(x, H_);
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the requested kernel path");
  const int64_t T = x.size(0), k = knobs_.top_k;
  TORCH_CHECK(ids.scalar_type() == torch::kInt32 && ids.is_contiguous() && ids.dim() == 2 && ids.size(0) == T &&
                  ids.size(1) == k,
              "ids must be a contiguous int32 [T, top_k]");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.is_contiguous() && weights.sizes() == ids.sizes(),
              "weights must be a contiguous float32 [T, top_k]");
  const int32_t* ip = ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < T * k; ++i) TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < E_, "expert id ", ip[i], " out of range");
  auto out = torch::empty({T, H_}, torch::kFloat32);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const size_t esize = x.element_size();
  run_as_team([&] {
    for (int64_t c0 = 0; c0 < T; c0 += kMoeChunkRows) {
      const int64_t n = std::min(kMoeChunkRows, T - c0);
      grouped(static_cast<const char*>(x.data_ptr()) + c0 * H_ * esize, bf16, n, ip + c0 * k,
              weights.data_ptr<float>() + c0 * k, isa, out.data_ptr<float>() + c0 * H_);
    }
  });
  return out;
}

torch::Tensor MoeLayer::shared_expert(const torch::Tensor& x, int64_t isa) const {
  auto s = project(silu_mul(project(x, shared_gate_up_, c10::nullopt, isa), isa), shared_down_, c10::nullopt, isa);
  return s.to(torch::kFloat32);
}

torch::Tensor MoeLayer::forward(const torch::Tensor& x, int64_t isa) const {
  check_rows(x, H_);
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the requested kernel path");
  const int64_t T = x.size(0), k = knobs_.top_k;
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto out = torch::empty({T, H_}, torch::kFloat32);
  std::vector<int32_t> ids(size_t(std::min(T, kMoeChunkRows) * k));
  std::vector<float> w(ids.size());
  run_as_team([&] {
    Scratch& sc = tl_scratch;
    for (int64_t c0 = 0; c0 < T; c0 += kMoeChunkRows) {
      const int64_t n = std::min(kMoeChunkRows, T - c0);
      const char* xp = static_cast<const char*>(x.data_ptr()) + c0 * H_ * x.element_size();
      const float* xf = reinterpret_cast<const float*>(xp);
      if (bf16) {  // the router reads float32 rows: bf16 widened exactly
        sc.xf.resize(size_t(n * H_));
        const uint16_t* b = reinterpret_cast<const uint16_t*>(xp);
        for (int64_t i = 0; i < n * H_; ++i) sc.xf[i] = from_bf16(b[i]);
        xf = sc.xf.data();
      }
      route_rows(xf, n, isa, ids.data(), w.data());
      grouped(xp, bf16, n, ids.data(), w.data(), isa, out.data_ptr<float>() + c0 * H_);
    }
    if (!shared_down_.empty()) {
      auto s = shared_expert(x, isa);
      if (shared_gate_.defined()) {
        auto g = torch::sigmoid(torch::matmul(x.to(torch::kFloat32), shared_gate_)).unsqueeze(1);
        s = s * g;
      }
      out.add_(s);
    }
  });
  return bf16 ? out.to(torch::kBFloat16) : out;
}

}  // namespace wsq
