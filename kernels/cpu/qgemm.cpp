// The quantized matmul's entry point: checks, activation quantization, the threaded loop over
// groups of output rows, and the run-time choice of ISA. Python: wsllm.kernels.quant.qlinear.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "qgemm.h"

namespace wsq {
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
struct ActBuffers {
  std::vector<float> d;
  std::vector<int32_t> s16;
  std::vector<int8_t> q, qx;
};

void quantize_rows(const float* x, int64_t m0, int64_t m1, int K, int bv, bool expand, ActBuffers& buf) {
  const float inv127 = float(1.0 / 127.0);
  const int nb = K / bv;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
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
    if (expand) {
      int8_t* e = buf.qx.data() + m * K * 8;
      for (int c = 0; c < K / 4; ++c)
        for (int r = 0; r < kRows; ++r)
          for (int j = 0; j < 4; ++j) e[c * 32 + r * 4 + j] = q[c * 4 + j];
    }
  }
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t n,
                      c10::optional<torch::Tensor> bias, int64_t isa) {
  TORCH_CHECK(qtype >= 0 && qtype < kNumQTypes, "unknown quantization type id ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
              "x must be a contiguous float32 CPU matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed weights must be contiguous uint8 [groups, blocks, bytes]");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0);
  const int bv = block_values(int(qtype)), pb = packed_bytes(int(qtype));
  TORCH_CHECK(K % bv == 0 && packed.size(1) == K / bv && packed.size(2) == pb, "packed weights do not fit x");
  TORCH_CHECK(n > (groups - 1) * kRows && n <= groups * kRows, "n does not fit the packed groups");
  TORCH_CHECK(cpu_has(int(isa)), "this CPU cannot run the requested kernel path");
  const float* bptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias must be contiguous float32 [n]");
    bptr = bias->data_ptr<float>();
  }
  const GroupFn fn = (isa == kAvx512Vnni ? kernels_avx512() : isa == kAvx2 ? kernels_avx2() : kernels_scalar())[qtype];
  const bool expand = isa != kScalar;

  ActBuffers buf;
  buf.d.resize(M * (K / bv));
  buf.s16.resize(M * (K / 16));
  buf.q.resize(M * K);
  if (expand) buf.qx.resize(M * K * 8);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) { quantize_rows(xp, m0, m1, int(K), bv, expand, buf); });
  Act a;
  a.K = int(K);
  a.nb = int(K / bv);
  a.d = buf.d.data();
  a.s16 = buf.s16.data();
  a.q = buf.q.data();
  a.qx = expand ? buf.qx.data() : nullptr;

  auto out = torch::empty({M, n}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const size_t group_bytes = size_t(K / bv) * pb;
  // Batch 1 streams every weight once: split the groups evenly over the threads. Larger M:
  // each group's blocks stay in cache while all rows of x go by, kMaxTile rows at a time.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    float tile[kMaxTile * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kRows;
      const int nvalid = int(std::min<int64_t>(kRows, n - n0));
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int mt = int(std::min<int64_t>(kMaxTile, M - m0));
        fn(wp + g * group_bytes, a, int(m0), mt, tile);
        for (int i = 0; i < mt; ++i) {
          float* o = op + (m0 + i) * n + n0;
          for (int r = 0; r < nvalid; ++r) o[r] = bptr ? tile[i * kRows + r] + bptr[n0 + r] : tile[i * kRows + r];
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace wsq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wsllm's quantized CPU kernels (GGUF blocks); see kernels/quant.py";
  m.def("qlinear", &wsq::qlinear, "x [M, K] float32 @ packed weights -> [M, n] float32", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("bias"), py::arg("isa"));
  m.def("cpu_has", &wsq::cpu_has, "can this CPU run the ISA path (0 avx512_vnni, 1 avx2, 2 scalar)?");
}
