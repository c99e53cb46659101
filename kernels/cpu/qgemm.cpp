// The quantized matmul's entry points (qlinear.h): checks, activation quantization, the threaded loop
// over groups of output rows, and the run-time choice of ISA. Python: wsllm.kernels.quant.qlinear.
#include "qlinear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "fvec.h"
#include "isa.h"
#include "qgemm.h"
#include "team.h"

namespace wsq {

int prefetch_ahead = kPrefetchAhead;
int prefetch_k45 = kPrefetchK45, prefetch_q6k = kPrefetchQ6K;

namespace {

// x rows m0 .. m1 - 1 (float32 or bfloat16 bits, made float32 exactly) -> int8 blocks, the scalar
// statement of the vector quantizers (qgemm_simd.h: quantize_rows), the same bits.
template <class T>
void quantize_rows(const T* x, int64_t m0, int64_t m1, int K, int bv, ActRows& a) {
  const float inv127 = float(1.0 / 127.0);
  const int nb = K / bv;
  std::unique_ptr<float[]> row(std::is_same<T, float>::value ? nullptr : new float[K]);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr;
    if constexpr (std::is_same<T, float>::value) {
      xr = x + m * K;
    } else {
      for (int l = 0; l < K; ++l) row[l] = widen(x[m * K + l]);
      xr = row.get();
    }
    int8_t* q = a.q.get() + m * K;
    for (int b = 0; b < nb; ++b) {
      float amax = 0.0f;
      for (int l = 0; l < bv; ++l) amax = std::fmax(amax, std::fabs(xr[b * bv + l]));
      const float d = amax * inv127;
      const float id = d == 0.0f ? 0.0f : 1.0f / d;
      a.d[m * nb + b] = d;
      for (int l = 0; l < bv; ++l) {
        const float v = std::nearbyint(xr[b * bv + l] * id);
        q[b * bv + l] = int8_t(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
      }
    }
    for (int g = 0; g < K / 16; ++g) {
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += q[g * 16 + l];
      a.s16[m * (K / 16) + g] = s;
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

}  // namespace

void ActRows::alloc(int64_t rows, int k, int block, bool pairs) {
  M = rows;
  K = k;
  bv = block;
  d.reset(new float[rows * (k / block)]);
  s16.reset(new int32_t[rows * (k / 16)]);
  q.reset(new int8_t[rows * k]);
  s16p.reset(pairs ? new int32_t[rows * (k / 32)] : nullptr);
}

Act ActRows::view(int64_t row) const {
  Act a;
  a.K = K;
  a.nb = K / bv;
  a.d = d.get() + row * a.nb;
  a.s16 = s16.get() + row * (K / 16);
  a.q = q.get() + row * K;
  a.s16p = s16p ? s16p.get() + row * (K / 32) : nullptr;
  return a;
}

QuantizeFn quantizer(int64_t isa) {
  return isa == kAvx512Vnni ? quantizer_avx512() : isa == kAvx2 ? quantizer_avx2() : nullptr;
}

GroupFn group_kernel(int64_t isa, int qtype) {
  return (isa == kAvx512Vnni ? kernels_avx512() : isa == kAvx2 ? kernels_avx2() : kernels_scalar())[qtype];
}

void quantize_act(const void* x, bool bf16, int64_t m0, int64_t m1, int64_t isa, ActRows& a) {
  const QuantizeFn qfn = quantizer(isa);
  if (qfn != nullptr)
    qfn(x, bf16, m0, m1, a.K, a.bv, a.d.get(), a.s16.get(), a.q.get());
  else if (bf16)
    quantize_rows(static_cast<const uint16_t*>(x), m0, m1, a.K, a.bv, a);
  else
    quantize_rows(static_cast<const float*>(x), m0, m1, a.K, a.bv, a);
  if (a.s16p) {  // Q6_K: the -32 offsets' x sums, two per broadcast (qgemm_simd.h: block_q6k)
    const int32_t* s = a.s16.get();
    for (int64_t i = m0 * (a.K / 32); i < m1 * (a.K / 32); ++i)
      a.s16p[i] = int32_t(uint32_t(uint16_t(s[2 * i])) | (uint32_t(uint16_t(s[2 * i + 1])) << 16));
  }
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
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the requested kernel path");
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->is_cpu(), "bias must be a CPU vector [n]");
    bias32 = bias->to(torch::kFloat32).contiguous();
  }
  const GroupFn fn = group_kernel(isa, int(qtype));
  ActRows buf;
  buf.alloc(M, int(K), bv, qtype == Q6_K);
  parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) { quantize_act(x.data_ptr(), bf16, m0, m1, isa, buf); });
  const Act a = buf.view();

  auto out = torch::empty({M, n}, out_float ? x.options().dtype(torch::kFloat32) : x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  if (bf16 && !out_float)
    run_groups(fn, a, wp, size_t(K / bv) * pb, groups, M, n, bp, out.data_ptr<at::BFloat16>());
  else
    run_groups(fn, a, wp, size_t(K / bv) * pb, groups, M, n, bp, out.data_ptr<float>());
  return out;
}

torch::Tensor project(const torch::Tensor& x, const std::vector<QPart>& parts, const c10::optional<torch::Tensor>& bias,
                      int64_t isa) {
  TORCH_CHECK(!parts.empty(), "a projection has at least one part");
  if (parts.size() == 1) return qlinear(x, parts[0].packed, parts[0].qtype, parts[0].n, bias, isa, false);
  std::vector<torch::Tensor> ys;
  for (const QPart& p : parts) ys.push_back(qlinear(x, p.packed, p.qtype, p.n, c10::nullopt, isa, false));
  auto y = torch::cat(ys, -1);
  return bias.has_value() ? y + *bias : y;
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

}  // namespace wsq
