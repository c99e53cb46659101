// Paged decode attention's entry point (kernels/cpu_attention.py): checks, the threaded loop
// over (sequence, kv head) pairs, the ISA choice, and the scalar path.
#include "attention.h"

#include "fvec.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "qgemm.h"
#include "rowops.h"
#include "team.h"

namespace wsq {
namespace {

// T: q's and out's element type, C: the caches' (as attention_simd.h)
template <class T, class C>
void decode_scalar_t(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  const int G = a.H / a.Hk, D = a.D;
  const int64_t row = int64_t(a.Hk) * D;
  const T* q = static_cast<const T*>(a.q);
  const C* k = static_cast<const C*>(a.k);
  const C* v = static_cast<const C*>(a.v);
  T* out = static_cast<T*>(a.out);
  float* qf = scratch;
  float* w = scratch + D;
  std::vector<float> acc(D);
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t s = item / a.Hk;
    const int hk = int(item % a.Hk), len = a.lens[s];
    const int32_t* table = a.tables + s * a.width;
    for (int g = 0; g < G; ++g) {
      const int h = hk * G + g;
      for (int j = 0; j < D; ++j) qf[j] = widen(q[s * a.q_stride + int64_t(h) * D + j]) * a.scale;
      float mx = -INFINITY;
      for (int p = 0; p < len; ++p) {
        const C* kr = k + (int64_t(table[p / a.bs]) * a.bs + p % a.bs) * row + int64_t(hk) * D;
        float d = 0.0f;
        for (int j = 0; j < D; ++j) d += qf[j] * widen(kr[j]);
        w[p] = d;
        mx = std::max(mx, d);
      }
      float sum = 0.0f;
      for (int p = 0; p < len; ++p) sum += (w[p] = std::exp(w[p] - mx));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int p = 0; p < len; ++p) {
        const C* vr = v + (int64_t(table[p / a.bs]) * a.bs + p % a.bs) * row + int64_t(hk) * D;
        for (int j = 0; j < D; ++j) acc[j] += w[p] * widen(vr[j]);
      }
      T* o = out + s * int64_t(a.H) * D + int64_t(h) * D;
      for (int j = 0; j < D; ++j) o[j] = narrow<T>(acc[j] / sum);
    }
  }
}

void decode_scalar(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  if (a.q_type == kBF16)
    return a.kv_type == kF16 ? decode_scalar_t<uint16_t, f16>(a, item0, item1, scratch)
                             : decode_scalar_t<uint16_t, uint16_t>(a, item0, item1, scratch);
  switch (a.kv_type) {
    case kBF16: return decode_scalar_t<float, uint16_t>(a, item0, item1, scratch);
    case kF16: return decode_scalar_t<float, f16>(a, item0, item1, scratch);
    default: return decode_scalar_t<float, float>(a, item0, item1, scratch);
  }
}

}  // namespace

DecodeFn decode_attention_scalar() { return decode_scalar; }

namespace {

// The checked inputs of one decode call, out aside.
struct Prepared {
  DecodeArgs a;
  DecodeFn fn;
  int64_t max_len;
};

// q: n rows of H heads of D values, q_stride elements apart (q alone, or the q part of the
// fused qkv rows); checks the caches, tables and lens against it, picks the ISA's function.
Prepared prepare(const void* q, at::ScalarType dt, int64_t q_stride, int64_t n, int64_t H, int64_t D,
                 const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& tables,
                 const torch::Tensor& lens, double scale, int64_t isa) {
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "q must be float32 or bfloat16");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == ct &&
                  (ct == dt || ct == torch::kFloat16 || (ct == torch::kBFloat16 && dt == torch::kFloat32)),
              "caches must be contiguous [blocks, block_size, Hk, D] of q's dtype, float16, or bfloat16 under "
              "float32 q");
  const int64_t Hk = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hk > 0 && H % Hk == 0, "q's heads must be a multiple of the cache's");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && tables.scalar_type() == torch::kInt32 &&
                  tables.is_contiguous(),
              "tables must be contiguous int32 [n, width]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == n && lens.scalar_type() == torch::kInt32 && lens.is_contiguous(),
              "lens must be contiguous int32 [n]");
  const int64_t width = tables.size(1), blocks = k_cache.size(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(lp[s] > 0 && lp[s] <= width * bs, "context length ", lp[s], " does not fit the block table");
    for (int64_t b = 0; b < (lp[s] + bs - 1) / bs; ++b)
      TORCH_CHECK_INDEX(tp[s * width + b] >= 0 && tp[s * width + b] < blocks, "block ", tp[s * width + b],
                        " out of range");
    max_len = std::max<int64_t>(max_len, lp[s]);
  }
  DecodeFn fn = decode_scalar;
  if (isa == kAvx512Vnni && D % 16 == 0)
    fn = decode_attention_avx512();
  else if ((isa == kAvx512Vnni || isa == kAvx2) && D % 8 == 0)
    fn = decode_attention_avx2();
  DecodeArgs a{q,       q_stride, k_cache.data_ptr(), v_cache.data_ptr(), tp,           width,
               lp,      int(H),   int(Hk),            int(D),             int(bs),      float(scale),
               dt == torch::kBFloat16 ? kBF16 : kF32,
               ct == torch::kFloat16 ? kF16 : ct == torch::kBFloat16 ? kBF16 : kF32,
               nullptr};
  return {a, fn, max_len};
}

void run(Prepared& p, int64_t n, void* out) {
  DecodeArgs& a = p.a;
  a.out = out;
  // A chunk must outweigh a fork/join: ~32K multiply-adds (2 G len D per item).
  const int64_t per_item = 2 * (a.H / a.Hk) * p.max_len * a.D;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(per_item, 1));
  parallel_for(0, n * a.Hk, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(decode_scratch_floats(a, p.max_len));
    p.fn(a, i0, i1, scratch.data());
  });
}

}  // namespace

// D not a multiple of the vector width takes the scalar path.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                               torch::Tensor lens, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.is_cpu() && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [n, H, D] with contiguous heads");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  Prepared p = prepare(q.data_ptr(), q.scalar_type(), q.stride(0), n, H, D, k_cache, v_cache, tables, lens, scale,
                       isa);
  auto out = torch::empty({n, H * D}, q.options());
  run(p, n, out.data_ptr());
  return out;
}

torch::Tensor rope_store_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, torch::Tensor tables,
                                torch::Tensor lens, double scale, int64_t isa) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && k_cache.dim() == 4, "qkv must be a contiguous matrix");
  const int64_t n = qkv.size(0), D = k_cache.size(3);
  Prepared p = prepare(qkv.data_ptr(), qkv.scalar_type(), qkv.size(1), n, num_heads, D, k_cache, v_cache, tables,
                       lens, scale, isa);
  rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  auto out = torch::empty({n, num_heads * D}, qkv.options());
  run(p, n, out.data_ptr());
  return out;
}

}  // namespace wsq
