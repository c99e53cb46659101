// The grouped LoRA pass on the CPU (kernels/lora.py: lora_apply_cpu): checks, the rows of every
// group flattened into one threaded loop (each row through its adapter's pieces: rows of one
// group next to each other, so A and B stay in cache between them), and the run-time choice of
// ISA; the scalar row is here, the vector rows in lora_simd.h.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "fvec.h"
#include "lora_weights.h"
#include "qgemm.h"

namespace wsq {

namespace {

template <class T>
void lora_row_scalar_t(const LoraPiece& p, const void* xv, void* yv, int64_t N, int64_t m) {
  const T* x = static_cast<const T*>(xv) + m * p.K;
  T* y = static_cast<T*>(yv) + m * N + p.offset;
  float t[kMaxLoraRank];
  for (int j = 0; j < p.r; ++j) {
    const float* a = p.a + int64_t(j) * p.K;
    float s = 0.0f;
    for (int k = 0; k < p.K; ++k) s = std::fmaf(widen(x[k]), a[k], s);
    t[j] = s;
  }
  for (int c = 0; c < p.n; ++c) {
    float u = 0.0f;
    for (int i = 0; i < p.r; ++i) u = std::fmaf(t[i], p.bt[int64_t(i) * p.n + c], u);
    y[c] = narrow<T>(widen(y[c]) + u);
  }
}

}  // namespace

LoraRowFn lora_row_scalar(bool bf16) { return bf16 ? lora_row_scalar_t<uint16_t> : lora_row_scalar_t<float>; }

LoraWeights::LoraWeights(std::vector<int64_t> keys, std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt,
                         std::vector<int64_t> offsets) {
  TORCH_CHECK(a.size() == keys.size() && bt.size() == keys.size() && offsets.size() == keys.size(),
              "LoraWeights: one key, A, B^T and offset per piece");
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& ai = a[i];
    const auto& bi = bt[i];
    TORCH_CHECK(keys[i] >= 0, "LoraWeights: a key is layer * 4 + slot");
    TORCH_CHECK(ai.dim() == 2 && bi.dim() == 2 && ai.scalar_type() == torch::kFloat32 &&
                    bi.scalar_type() == torch::kFloat32 && ai.is_contiguous() && bi.is_contiguous() && ai.is_cpu() &&
                    bi.is_cpu() && ai.size(0) == bi.size(0),
                "LoraWeights: A [r, K] and B^T [r, n], contiguous float32 CPU tensors of one rank");
    TORCH_CHECK(ai.size(0) >= 1 && ai.size(0) <= kMaxLoraRank, "LoraWeights: rank within 1 and ", kMaxLoraRank);
    TORCH_CHECK(offsets[i] >= 0, "LoraWeights: offsets are >= 0");
    held_.push_back(ai);
    held_.push_back(bi);
    if (keys[i] >= int64_t(by_key_.size())) by_key_.resize(keys[i] + 1);
    by_key_[keys[i]].push_back(LoraPiece{ai.data_ptr<float>(), bi.data_ptr<float>(), int(ai.size(0)),
                                         int(ai.size(1)), int(bi.size(1)), offsets[i]});
  }
}

void lora_apply(torch::Tensor y, const torch::Tensor& x, int64_t key, const LoraList& adapters,
                const std::vector<torch::Tensor>& rows, int64_t isa) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_cpu() && y.is_cpu() &&
                  x.is_contiguous() && y.is_contiguous() && y.scalar_type() == x.scalar_type() &&
                  (bf16 || x.scalar_type() == torch::kFloat32),
              "lora_apply: x [M, K] and y [M, N], contiguous float32 or bfloat16 CPU matrices of one type");
  TORCH_CHECK(rows.size() == adapters.size(), "lora_apply: one row list per adapter");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  std::vector<std::pair<int32_t, int64_t>> work;  // (group, row), a group's rows together
  int64_t cost = 0;                              // multiply-adds of the whole pass
  for (size_t g = 0; g < adapters.size(); ++g) {
    TORCH_CHECK(adapters[g] != nullptr, "lora_apply: an adapter is None");
    const auto& pieces = adapters[g]->at(key);
    if (pieces.empty()) continue;
    int64_t per_row = 0;
    for (const auto& p : pieces) {
      TORCH_CHECK(p.K == K && p.offset + p.n <= N, "lora_apply: an adapter's piece does not fit x or y");
      per_row += int64_t(p.r) * (p.K + p.n);
    }
    const auto& r = rows[g];
    if (r.numel() == 0) {
      for (int64_t m = 0; m < M; ++m) work.emplace_back(int32_t(g), m);
      cost += per_row * M;
      continue;
    }
    TORCH_CHECK(r.dim() == 1 && r.scalar_type() == torch::kInt64 && r.is_contiguous() && r.is_cpu(),
                "lora_apply: rows are int64 [m] CPU vectors");
    const int64_t* rp = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.numel(); ++i) {
      TORCH_CHECK_INDEX(rp[i] >= 0 && rp[i] < M, "lora_apply: row ", rp[i], " out of range [0, ", M, ")");
      work.emplace_back(int32_t(g), rp[i]);
    }
    cost += per_row * r.numel();
  }
  if (work.empty()) return;
  const LoraRowFn fn = isa == kAvx512Vnni ? lora_row_avx512(bf16) : isa == kAvx2 ? lora_row_avx2(bf16)
                                                                                  : lora_row_scalar(bf16);
  const int64_t n = int64_t(work.size());
  // a thread's share must outweigh the fork/join: at least ~64K multiply-adds per chunk
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) * n / std::max<int64_t>(cost, 1));
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (const auto& p : adapters[work[i].first]->at(key)) fn(p, xp, yp, N, work[i].second);
    }
  });
}

void register_lora(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LoraWeights, std::shared_ptr<LoraWeights>>(m, "LoraWeights")
      .def(py::init<std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>>(),
           py::arg("keys"), py::arg("a"), py::arg("bt"), py::arg("offsets"))
      .def_property_readonly("num_pieces", &LoraWeights::num_pieces);
  m.def("lora_apply", &lora_apply,
        "y [M, N] += each adapter's low-rank delta of projection `key` on its rows of x [M, K]; see kernels/lora.py",
        py::arg("y"), py::arg("x"), py::arg("key"), py::arg("adapters"), py::arg("rows"), py::arg("isa"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace wsq
