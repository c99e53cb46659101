// The quantized matmul's entry point: checks, activation quantization, the threaded loop over
// groups of output rows, and the run-time choice of ISA. Python: wsllm.kernels.quant.qlinear.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "lora_weights.h"
#include "qgemm.h"
#include "rowops.h"
#include "team.h"

namespace wsq {
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                               torch::Tensor lens, double scale, int64_t isa);  // attention.cpp
torch::Tensor rope_store_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, torch::Tensor tables,
                                torch::Tensor lens, double scale, int64_t isa);  // attention.cpp
void register_sampling(pybind11::module& m);  // sample.cpp
}  // namespace wsq

namespace wsq {

int prefetch_ahead = kPrefetchAhead;
int prefetch_k45 = kPrefetchK45, prefetch_q6k = kPrefetchQ6K;

namespace {

bool cpu_has(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kAvx512Vnni:
      return kernels_avx512() != nullptr && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx2:
      return kernels_avx2() != nullptr && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case kScalar:
      return true;
    default:
      return false;
  }
}

// x rows -> int8 blocks, as quant_ref.quantize_activations: d = amax * (1/127), q = round(x / d)
// written round(x * (1 / d)), ties to even (nearbyint under the default rounding mode).
template <class T>
struct Buffer {  // uninitialised (std::vector would zero what is written next anyway)
  std::unique_ptr<T[]> p;
  void resize(size_t n) { p.reset(new T[n]); }
  T* data() { return p.get(); }
  T& operator[](size_t i) { return p[i]; }
};

struct ActBuffers {
  Buffer<float> d;
  Buffer<int32_t> s16;
  Buffer<int8_t> q;
  Buffer<int32_t> s16p;
};

// x rows m0 .. m1 - 1 (float32 or bfloat16, made float32 exactly) -> int8 blocks.
template <class T>
void quantize_rows(const T* x, int64_t m0, int64_t m1, int K, int bv, ActBuffers& buf) {
  const float inv127 = float(1.0 / 127.0);
  const int nb = K / bv;
  std::unique_ptr<float[]> row(std::is_same<T, float>::value ? nullptr : new float[K]);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr;
    if constexpr (std::is_same<T, float>::value) {
      xr = x + m * K;
    } else {
      for (int l = 0; l < K; ++l) row[l] = float(x[m * K + l]);
      xr = row.get();
    }
    int8_t* q = buf.q.data() + m * K;
    for (int b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (int l = 0; l < bv; ++l) amax = std::fmax(amax, std::fabs(xr[b * bv + l]));
      const float d = amax * inv127;
      const float id = d == 0.0f ? 0.0f : 1.0f / d;
      buf.d[m * nb + b] = d;
      for (int l = 0; l < bv; ++l) {
        const float v = std::nearbyint(xr[b * bv + l] * id);
        q[b * bv + l] = int8_t(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
      }
    }
    for (int g = 0; g < K / 16; ++g) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += q[g * 16 + l];
      buf.s16[m * (K / 16) + g] = s;
    }
  }
}

// out [M, n] (float32 or bfloat16, rounded to nearest even as torch rounds) = the groups'
// sums + bias. Batch 1 streams every weight once, the groups split evenly over the threads;
// larger M: each group's blocks stay in cache while the rows of x go by, kMaxTile at a time.
template <class T>
void run_groups(GroupFn fn, const Act& a, const uint8_t* wp, size_t group_bytes, int64_t groups, int64_t M,
                int64_t n, const float* bias, T* op) {
  // A thread's share must outweigh the fork/join (a few microseconds): at least ~64K
  // multiply-adds per chunk, so a small layer at batch 1 runs on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kRows * a.K * std::max<int64_t>(M, 1)));
  parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    float tile[kMaxTile * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kRows;
      const int nvalid = int(std::min<int64_t>(kRows, n - n0));
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int mt = int(std::min<int64_t>(kMaxTile, M - m0));
        fn(wp + g * group_bytes, a, int(m0), mt, tile);
        for (int i = 0; i < mt; ++i) {
          T* o = op + (m0 + i) * n + n0;
          for (int r = 0; r < nvalid; ++r) o[r] = T(bias ? tile[i * kRows + r] + bias[n0 + r] : tile[i * kRows + r]);
        }
      }
    }
  });
}

// x [M, K] float32 or bfloat16 -> [M, n] in x's dtype, or float32 when out_float (kernels/quant.py:
// qlinear). Runs without the GIL, as torch's own ops do: the gateway's thread serves meanwhile.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t n,
                      c10::optional<torch::Tensor> bias, int64_t isa, bool out_float) {
  TORCH_CHECK(qtype >= 0 && qtype < kNumQTypes, "unknown quantization type id ", qtype);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == torch::kFloat32) && x.is_contiguous() && x.is_cpu(),
              "x must be a contiguous float32 or bfloat16 CPU matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed weights must be contiguous uint8 [groups, blocks, bytes]");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0);
  const int bv = block_values(int(qtype)), pb = packed_bytes(int(qtype));
  TORCH_CHECK(K % bv == 0 && packed.size(1) == K / bv && packed.size(2) == pb, "packed weights do not fit x");
  TORCH_CHECK(n > (groups - 1) * kRows && n <= groups * kRows, "n does not fit the packed groups");
  TORCH_CHECK(cpu_has(int(isa)), "this CPU cannot run the requested kernel path");
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->is_cpu(), "bias must be a CPU vector [n]");
    bias32 = bias->to(torch::kFloat32).contiguous();
  }
  const GroupFn fn = (isa == kAvx512Vnni ? kernels_avx512() : isa == kAvx2 ? kernels_avx2() : kernels_scalar())[qtype];

  ActBuffers buf;
  buf.d.resize(M * (K / bv));
  buf.s16.resize(M * (K / 16));
  buf.q.resize(M * K);
  const QuantizeFn qfn = isa == kAvx512Vnni ? quantizer_avx512() : isa == kAvx2 ? quantizer_avx2() : nullptr;
  parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    if (qfn != nullptr)
      qfn(x.data_ptr(), bf16, m0, m1, int(K), bv, buf.d.data(), buf.s16.data(), buf.q.data());
    else if (bf16)
      quantize_rows(x.data_ptr<at::BFloat16>(), m0, m1, int(K), bv, buf);
    else
      quantize_rows(x.data_ptr<float>(), m0, m1, int(K), bv, buf);
  });
  Act a;
  a.K = int(K);
  a.nb = int(K / bv);
  a.d = buf.d.data();
  a.s16 = buf.s16.data();
  a.q = buf.q.data();
  if (qtype == Q6_K) {  // the -32 offsets' x sums, two per broadcast (qgemm_simd.h: block_q6k)
    buf.s16p.resize(M * (K / 32));
    for (int64_t i = 0; i < M * (K / 32); ++i)
      buf.s16p[i] = int32_t(uint32_t(uint16_t(buf.s16[2 * i])) | (uint32_t(uint16_t(buf.s16[2 * i + 1])) << 16));
    a.s16p = buf.s16p.data();
  }

  auto out = torch::empty({M, n}, out_float ? x.options().dtype(torch::kFloat32) : x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  if (bf16 && !out_float)
    run_groups(fn, a, wp, size_t(K / bv) * pb, groups, M, n, bp, out.data_ptr<at::BFloat16>());
  else
    run_groups(fn, a, wp, size_t(K / bv) * pb, groups, M, n, bp, out.data_ptr<float>());
  return out;
}

// rows int64 [R] -> float32 [R, K]: embedding lookups and whole-weight dequantization.
torch::Tensor dequant_rows(torch::Tensor packed, int64_t qtype, int64_t n, torch::Tensor rows) {
  TORCH_CHECK(qtype >= 0 && qtype < kNumQTypes, "unknown quantization type id ", qtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.size(2) == packed_bytes(int(qtype)),
              "packed weights must be contiguous uint8 [groups, blocks, bytes]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "rows: int64 [R]");
  const int64_t R = rows.size(0), nb = packed.size(1), groups = packed.size(0);
  const int64_t K = nb * block_values(int(qtype));
  const int64_t* rp = rows.data_ptr<int64_t>();
  TORCH_CHECK(n > (groups - 1) * kRows && n <= groups * kRows, "n does not fit the packed groups");
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK_INDEX(rp[i] >= 0 && rp[i] < n, "row ", rp[i], " out of range [0, ", n, ")");
  auto out = torch::empty({R, K}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const size_t group_bytes = size_t(nb) * packed_bytes(int(qtype));
  parallel_for(0, R, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      dequant_row(int(qtype), wp + (rp[i] / kRows) * group_bytes, int(nb), int(rp[i] % kRows), op + i * K);
  });
  return out;
}

// How many of torch's threads an at::parallel_for of this module runs on: 1 whatever
// torch's setting when the build lacks OpenMP (tests/unit/test_quant_kernels.py checks it).
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
    volatile double spin = 0;  // long enough that every thread gets a share
    for (int i = 0; i < 200000; ++i) spin = spin + 1.0;
    seen.fetch_or(uint64_t(1) << (at::get_thread_num() % 64));
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace

// The decode layers of a model over quantized weights in one call (kernels/quant.py: DecodeStack):
// per layer the calls wsllm/models/llama.py's DecoderLayer makes one by one (add_rms_norm, the
// qkv matmul, rope_store_decode, o, add_rms_norm, gate/up, silu_mul, down), in the same order on
// the same kernels, so the same bits; what goes is the Python and pybind between them (~8 calls
// a layer, a few microseconds each: a tenth of a batch-1 step of a small model).
class DecodeStack {
 public:
  // per layer: norms (input, post-attention); the projections qkv, o, gate_up, down, each in
  // `parts` pieces (1, or a split projection's formats: SplitLinear), whose packed weights,
  // qtypes and output widths ns follow in order; qkv_bias (an empty tensor: none); caches (k, v).
  DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> packed, std::vector<int64_t> qtypes,
              std::vector<int64_t> ns, std::vector<int64_t> parts, std::vector<torch::Tensor> qkv_bias,
              std::vector<torch::Tensor> caches, int64_t num_heads, double eps, double scale)
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
  }

  int64_t num_layers() const { return layers_; }

  // x [n, hidden] (the embeddings) -> (the last layer's output, its residual), as the layers'
  // loop in LlamaForCausalLM.forward leaves them for the final norm. `lora`, `lora_rows`: the
  // step's adapters and their rows (lora_weights.h), added after each projection as the Python
  // layers add them.
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                     torch::Tensor tables, torch::Tensor lens, int64_t isa, const LoraList& lora,
                                     const std::vector<torch::Tensor>& lora_rows) {
    torch::Tensor residual;
    run_as_team([&] { layers(x, residual, cos, sin, slots, tables, lens, isa, lora, lora_rows); });
    return {x, residual};
  }

 private:
  // the layers, on the calling thread's team (team.h): one OpenMP region for the whole stack
  void layers(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& cos, const torch::Tensor& sin,
              const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens, int64_t isa,
              const LoraList& lora, const std::vector<torch::Tensor>& lora_rows) {
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
      auto o = rope_store_decode(qkv, cos, sin, caches_[2 * l], caches_[2 * l + 1], slots, num_heads_, tables, lens,
                                 scale_, isa);
      auto r = add_rms_norm(project(o, p + 1, c10::nullopt, isa, lora, lora_rows), residual, norms_[2 * l + 1],
                            eps_, isa);
      residual = r[1];
      auto gate_up = project(r[0], p + 2, c10::nullopt, isa, lora, lora_rows);
      x = project(silu_mul(gate_up, isa), p + 3, c10::nullopt, isa, lora, lora_rows);
    }
  }

  // the projection, and the step's adapters' deltas on their rows (none: nothing more)
  torch::Tensor project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias, int64_t isa,
                        const LoraList& lora, const std::vector<torch::Tensor>& rows) {
    auto y = base_project(x, p, bias, isa);
    if (!lora.empty()) lora_apply(y, x, p, lora, rows, isa);
    return y;
  }

  // QuantLinear.forward, or SplitLinear.forward (the parts side by side, then + bias)
  torch::Tensor base_project(const torch::Tensor& x, int64_t p, const c10::optional<torch::Tensor>& bias, int64_t isa) {
    const int64_t i = first_[p];
    if (parts_[p] == 1) return qlinear(x, packed_[i], qtypes_[i], ns_[i], bias, isa, false);
    std::vector<torch::Tensor> ys;
    for (int64_t k = i; k < i + parts_[p]; ++k) ys.push_back(qlinear(x, packed_[k], qtypes_[k], ns_[k], c10::nullopt, isa, false));
    auto y = torch::cat(ys, -1);
    return bias.has_value() ? y + *bias : y;
  }

  std::vector<torch::Tensor> norms_, packed_;
  std::vector<int64_t> qtypes_, ns_, parts_, first_;
  std::vector<c10::optional<torch::Tensor>> bias_;
  std::vector<torch::Tensor> caches_;
  int64_t num_heads_, layers_ = 0;
  double eps_, scale_;
};

}  // namespace wsq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wsllm's quantized CPU kernels (GGUF blocks); see kernels/quant.py";
  wsq::register_lora(m);  // LoraWeights first: DecodeStack.forward takes a list of them
  wsq::register_sampling(m);
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("qlinear", &wsq::qlinear, "x [M, K] float32/bfloat16 @ packed weights (+ bias) -> [M, n] in x's dtype", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("bias"), py::arg("isa"), py::arg("out_float") = false,
        nogil());
  m.def("dequant_rows", &wsq::dequant_rows, "packed weights of n rows, rows int64 [R] -> float32 [R, K]", nogil());
  m.def("add_rms_norm", &wsq::add_rms_norm, "(rms_norm(x + residual) * weight, x + residual); see rowops.h",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("isa") = 2);
  m.def("silu_mul", &wsq::silu_mul, "[T, 2 d] -> silu(gate) * up [T, d]", py::arg("x"), py::arg("isa") = 2);
  m.def("rope_store", &wsq::rope_store, "rotary on qkv's q and k in place, k and v into the caches");
  m.def("decode_attention", &wsq::decode_attention,
        "q [n, H, D] against the paged caches through tables [n, width] and lens [n] -> [n, H * D]; see fvec.h",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("scale"),
        py::arg("isa"), nogil());
  m.def("rope_store_decode", &wsq::rope_store_decode,
        "rope_store then decode_attention of qkv's rotated q rows -> [n, H * D]: a decode-only step's attention",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("num_heads"), py::arg("tables"), py::arg("lens"), py::arg("scale"), py::arg("isa"), nogil());
  py::class_<wsq::DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, double,
                    double>(),
           py::arg("norms"), py::arg("packed"), py::arg("qtypes"), py::arg("ns"), py::arg("parts"), py::arg("qkv_bias"),
           py::arg("caches"), py::arg("num_heads"), py::arg("eps"), py::arg("scale"))
      .def_property_readonly("num_layers", &wsq::DecodeStack::num_layers)
      .def("forward", &wsq::DecodeStack::forward,
           "a decode-only step's layers: x [n, hidden] -> (out, residual); see kernels/quant.py",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("tables"), py::arg("lens"),
           py::arg("isa"), py::arg("lora") = wsq::LoraList(), py::arg("lora_rows") = std::vector<torch::Tensor>(),
           nogil());
  m.def(
      "set_prefetch_ahead", [](int64_t bytes) { wsq::prefetch_ahead = int(bytes); },
      "bench/quantized_linear.py: how far ahead of its loads the 32-value formats' batch-1 stream prefetches (0: off)");
  m.def(
      "set_prefetch_k",
      [](int64_t k45, int64_t q6k) {
        wsq::prefetch_k45 = int(k45);
        wsq::prefetch_q6k = int(q6k);
      },
      "bench/quantized_linear.py: bytes ahead that Q4_K/Q5_K (batch 1) and Q6_K prefetch (0: off)", py::arg("k45"),
      py::arg("q6k"));
  m.def("set_teams", &wsq::set_teams, "the decode stack on one team of threads (team.h) or an at::parallel_for a loop",
        py::arg("on") = true, py::arg("hold_helpers") = false);
  m.def("team_threads", &wsq::team_threads, "threads that took chunks of a team's loop", nogil());
  m.def("parallel_threads", &wsq::parallel_threads, "threads an at::parallel_for here runs on");
  m.def("cpu_has", &wsq::cpu_has, "can this CPU run the ISA path (0 avx512_vnni, 1 avx2, 2 scalar)?");
}
