// The grouped LoRA pass on the CPU (kernels/lora.py: lora_apply_cpu): checks, every group's rows
// cut into tiles of up to kLoraTile rows and the tiles run in one threaded loop (each tile through
// its adapter's pieces, reading A and B once for its rows), and the run-time choice of ISA; the
// scalar tile is here, the vector tiles in lora_simd.h.

#include <algorithm>
#include <cmath>

#include "fvec.h"
#include "lora_weights.h"
#include "qgemm.h"
#include "team.h"

namespace wsq {

namespace {

// the scalar tile: each row alone, in plain order (other bits than a vector path's: each path
// equals the reference within its tolerance, and each is the same for a row whatever its batch)
template <class T, class W>
void lora_tile_scalar_t(const LoraPiece& p, const void* xv, void* yv, int64_t N, const int64_t* rows, int mt) {
  const W* A = static_cast<const W*>(p.a);
  const W* B = static_cast<const W*>(p.bt);
  float t[kMaxLoraRank];
  for (int i = 0; i < mt; ++i) {
    const T* x = static_cast<const T*>(xv) + rows[i] * p.K;
    T* y = static_cast<T*>(yv) + rows[i] * N + p.offset;
    for (int j = 0; j < p.r; ++j) {
      float s = 0.0f;
      for (int k = 0; k < p.K; ++k) s = std::fmaf(widen(x[k]), widen(A[int64_t(j) * p.K + k]), s);
      t[j] = s;
    }
    for (int c = 0; c < p.n; ++c) {
      float u = 0.0f;
      for (int q = 0; q < p.r; ++q) u = std::fmaf(t[q], widen(B[int64_t(q) * p.n + c]), u);
      y[c] = narrow<T>(widen(y[c]) + u);
    }
  }
}

template <class T, class W, int MT>
void lora_tile_scalar_n(const LoraPiece& p, const void* x, void* y, int64_t N, const int64_t* rows) {
  lora_tile_scalar_t<T, W>(p, x, y, N, rows, MT);
}

template <class T, class W>
LoraTileFn scalar_of(int rows) {
  switch (rows) {
    case 1:
      return lora_tile_scalar_n<T, W, 1>;
    case 2:
      return lora_tile_scalar_n<T, W, 2>;
    case 3:
      return lora_tile_scalar_n<T, W, 3>;
    default:
      return lora_tile_scalar_n<T, W, 4>;
  }
}

}  // namespace

LoraTileFn lora_tile_scalar(bool x_bf16, bool w_bf16, int rows) {
  if (x_bf16) return w_bf16 ? scalar_of<uint16_t, uint16_t>(rows) : scalar_of<uint16_t, float>(rows);
  return w_bf16 ? scalar_of<float, uint16_t>(rows) : scalar_of<float, float>(rows);
}

LoraWeights::LoraWeights(std::vector<int64_t> keys, std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt,
                         std::vector<int64_t> offsets) {
  TORCH_CHECK(a.size() == keys.size() && bt.size() == keys.size() && offsets.size() == keys.size(),
              "LoraWeights: one key, A, B^T and offset per piece");
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& ai = a[i];
    const auto& bi = bt[i];
    const auto dt = ai.scalar_type();
    TORCH_CHECK(keys[i] >= 0, "LoraWeights: a key is layer * 4 + slot");
    TORCH_CHECK(ai.dim() == 2 && bi.dim() == 2 && (dt == torch::kFloat32 || dt == torch::kBFloat16) &&
                    bi.scalar_type() == dt && ai.is_contiguous() && bi.is_contiguous() && ai.is_cpu() &&
                    bi.is_cpu() && ai.size(0) == bi.size(0),
                "LoraWeights: A [r, K] and B^T [r, n], contiguous float32 or bfloat16 CPU tensors of one type and rank");
    TORCH_CHECK(ai.size(0) >= 1 && ai.size(0) <= kMaxLoraRank, "LoraWeights: rank within 1 and ", kMaxLoraRank);
    TORCH_CHECK(offsets[i] >= 0, "LoraWeights: offsets are >= 0");
    held_.push_back(ai);
    held_.push_back(bi);
    if (keys[i] >= int64_t(by_key_.size())) by_key_.resize(keys[i] + 1);
    by_key_[keys[i]].push_back(LoraPiece{ai.data_ptr(), bi.data_ptr(), dt == torch::kBFloat16, int(ai.size(0)),
                                         int(ai.size(1)), int(bi.size(1)), offsets[i]});
  }
}

namespace {

struct Tile {
  int32_t group;
  int32_t count;  // rows in it, 1 .. kLoraTile
  int64_t first;  // its first row's place in the flat row list
};

// The tiles of every group that has pieces of projection `key`, a group's rows kLoraTile at a time
// (flat: every group's rows one after another), into `tiles`; the pass's multiply-adds to `cost`.
void tiles_of(const LoraList& adapters, const std::vector<torch::Tensor>& rows, int64_t key, int64_t M, int64_t K,
              int64_t N, std::vector<int64_t>& flat, std::vector<Tile>& tiles, int64_t& cost) {
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
    const int64_t first = int64_t(flat.size());
    if (r.numel() == 0) {
      for (int64_t m = 0; m < M; ++m) flat.push_back(m);
    } else {
      TORCH_CHECK(r.dim() == 1 && r.scalar_type() == torch::kInt64 && r.is_contiguous() && r.is_cpu(),
                  "lora_apply: rows are int64 [m] CPU vectors");
      const int64_t* rp = r.data_ptr<int64_t>();
      for (int64_t i = 0; i < r.numel(); ++i) {
        TORCH_CHECK_INDEX(rp[i] >= 0 && rp[i] < M, "lora_apply: row ", rp[i], " out of range [0, ", M, ")");
        flat.push_back(rp[i]);
      }
    }
    const int64_t m = int64_t(flat.size()) - first;
    cost += per_row * m;
    for (int64_t i = 0; i < m; i += kLoraTile)
      tiles.push_back(Tile{int32_t(g), int32_t(std::min<int64_t>(kLoraTile, m - i)), first + i});
  }
}

}  // namespace

void lora_apply(torch::Tensor y, const torch::Tensor& x, int64_t key, const LoraList& adapters,
                const std::vector<torch::Tensor>& rows, int64_t isa) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_cpu() && y.is_cpu() &&
                  x.is_contiguous() && y.is_contiguous() && y.scalar_type() == x.scalar_type() &&
                  (bf16 || x.scalar_type() == torch::kFloat32),
              "lora_apply: x [M, K] and y [M, N], contiguous float32 or bfloat16 CPU matrices of one type");
  TORCH_CHECK(rows.size() == adapters.size(), "lora_apply: one row list per adapter");
  // reused per thread: a decode step makes 4 calls a layer, each a few microseconds
  thread_local std::vector<int64_t> flat;
  thread_local std::vector<Tile> tiles;
  thread_local std::vector<std::pair<int32_t, int32_t>> items;  // (tile, piece), a tile's pieces together
  flat.clear();
  tiles.clear();
  items.clear();
  int64_t cost = 0;  // multiply-adds of the whole pass
  tiles_of(adapters, rows, key, x.size(0), x.size(1), y.size(1), flat, tiles, cost);
  if (tiles.empty()) return;
  const auto pick = isa == kAvx512Vnni ? lora_tile_avx512 : isa == kAvx2 ? lora_tile_avx2 : lora_tile_scalar;
  // One item: a tile through one piece. The pieces of a projection write columns of their own, so
  // a one-row decode step's q, k and v (gate and up) can go to two threads: at rank 64 one thread
  // alone read the adapter at about half the machine's bandwidth.
  for (size_t i = 0; i < tiles.size(); ++i)
    for (size_t k = 0; k < adapters[tiles[i].group]->at(key).size(); ++k) items.emplace_back(int32_t(i), int32_t(k));
  const int64_t n = int64_t(items.size()), N = y.size(1);
  // a thread's share must outweigh the fork/join: at least ~64K multiply-adds per chunk
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) * n / std::max<int64_t>(cost, 1));
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  const auto& tiles_here = tiles;  // the caller's: a worker thread's thread_locals are its own
  const auto& items_here = items;
  const int64_t* flat_here = flat.data();
  parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& t = tiles_here[items_here[i].first];
      const LoraPiece& p = adapters[t.group]->at(key)[items_here[i].second];
      pick(bf16, p.bf16, t.count)(p, xp, yp, N, flat_here + t.first);
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
