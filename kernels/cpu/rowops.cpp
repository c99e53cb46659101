// The row ops of rowops.h. Plain loops (the rows are a few hundred to a few thousand values);
// float arithmetic in the references' order and rounding (-ffp-contract=off: no FMA).
#include "rowops.h"

#include "fvec.h"
#include "qgemm.h"
#include "team.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace wsq {
namespace {

// Rows per parallel chunk: a thread's share must outweigh a fork/join (~64K values).
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(row_len, 1)); }

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              what, " must be a contiguous float32 or bfloat16 CPU matrix");
}

template <class T>
void norm_rows(const T* x, const T* res, const T* w, T* out, T* h, int64_t m0, int64_t m1, int64_t K, float eps) {
  std::vector<float> row(K);
  for (int64_t m = m0; m < m1; ++m) {
    float ss = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      T v = x[m * K + j];
      if (res != nullptr) {
        v = T(float(v) + float(res[m * K + j]));  // x + residual in x's dtype, as torch adds
        h[m * K + j] = v;
      }
      row[j] = float(v);
      ss += row[j] * row[j];
    }
    const float r = 1.0f / std::sqrt(ss / float(K) + eps);
    for (int64_t j = 0; j < K; ++j) out[m * K + j] = T(float(w[j]) * float(T(row[j] * r)));
  }
}

template <class T>
void silu_rows(const T* x, T* out, int64_t m0, int64_t m1, int64_t d) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* g = x + m * 2 * d;
    for (int64_t j = 0; j < d; ++j) {
      const float a = float(g[j]);
      const T s = T(a / (1.0f + std::exp(-a)));
      out[m * d + j] = T(float(s) * float(g[d + j]));
    }
  }
}

// n values of src into dst: a copy, or each rounded to the cache's type (nearest even, as torch's .to())
template <class T, class C>
void put_row(C* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, C>)
    std::memcpy(dst, src, sizeof(T) * n);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = C(float(src[i]));
}

template <class T, class C>
void rope_rows(T* qkv, const float* cos, const float* sin, C* kc, C* vc, const int64_t* slots, int64_t t0,
               int64_t t1, int64_t H, int64_t Hk, int64_t D) {
  const int64_t width = (H + 2 * Hk) * D, half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t t = t0; t < t1; ++t) {
    T* row = qkv + t * width;
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t hd = 0; hd < H + Hk; ++hd) {
      T* x = row + hd * D;
      for (int64_t j = 0; j < D; ++j) tmp[j] = float(x[j]) * c[j] + float(x[j < half ? j + half : j - half]) * s[j];
      for (int64_t j = 0; j < D; ++j) x[j] = T(tmp[j]);
    }
    put_row(kc + slots[t] * Hk * D, row + H * D, Hk * D);
    put_row(vc + slots[t] * Hk * D, row + (H + Hk) * D, Hk * D);
  }
}

}  // namespace

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps, int64_t isa) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == K && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "weight must be a contiguous vector [K] of x's dtype");
  torch::Tensor h = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(),
                "residual must be contiguous, with x's shape and dtype");
    h = torch::empty(x.sizes(), x.options());  // x is contiguous: one op, not empty_like's two
  }
  auto out = torch::empty(x.sizes(), x.options());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const NormFn vec = isa == kAvx512Vnni ? norm_rows_avx512(bf16) : isa == kAvx2 ? norm_rows_avx2(bf16) : nullptr;
  if (vec != nullptr) {
    const void* rp = residual.has_value() ? residual->data_ptr() : nullptr;
    parallel_for(0, M, grain(K), [&](int64_t m0, int64_t m1) {
      vec(x.data_ptr(), rp, weight.data_ptr(), out.data_ptr(), h.data_ptr(), m0, m1, K, float(eps));
    });
    return {out, h};
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm", AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       using T = scalar_t;
                       const T* rp = residual.has_value() ? residual->data_ptr<T>() : nullptr;
                       parallel_for(0, M, grain(K), [&](int64_t m0, int64_t m1) {
                         norm_rows<T>(x.data_ptr<T>(), rp, weight.data_ptr<T>(), out.data_ptr<T>(), h.data_ptr<T>(),
                                      m0, m1, K, float(eps));
                       });
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       using T = scalar_t;
                       const T* rp = residual.has_value() ? residual->data_ptr<T>() : nullptr;
                       parallel_for(0, M, grain(K), [&](int64_t m0, int64_t m1) {
                         norm_rows<T>(x.data_ptr<T>(), rp, weight.data_ptr<T>(), out.data_ptr<T>(), h.data_ptr<T>(),
                                      m0, m1, K, float(eps));
                       });
                     }));
  return {out, h};
}

torch::Tensor silu_mul(torch::Tensor x, int64_t isa) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t M = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({M, d}, x.options());
  // on a vector path the exp runs in vectors (scalar std::exp was most of a 32-row step's row ops)
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const SiluFn vec = isa == kAvx512Vnni ? silu_mul_avx512(bf16) : isa == kAvx2 ? silu_mul_avx2(bf16) : nullptr;
  if (vec != nullptr) {
    parallel_for(0, M, grain(2 * d), [&](int64_t m0, int64_t m1) { vec(x.data_ptr(), out.data_ptr(), m0, m1, d); });
    return out;
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "silu_mul", AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       parallel_for(0, M, grain(2 * d), [&](int64_t m0, int64_t m1) {
                         silu_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), m0, m1, d);
                       });
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       parallel_for(0, M, grain(2 * d), [&](int64_t m0, int64_t m1) {
                         silu_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), m0, m1, d);
                       });
                     }));
  return out;
}

void rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads) {
  check_rows(qkv, "qkv");
  const auto dt = qkv.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == ct &&
                  (ct == dt || ct == torch::kFloat16 || (ct == torch::kBFloat16 && dt == torch::kFloat32)),
              "caches must be contiguous [blocks, block_size, Hk, D] of qkv's dtype, float16, or bfloat16 "
              "under float32");
  const int64_t T = qkv.size(0), Hk = k_cache.size(2), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hk) * D && D % 2 == 0, "qkv must be [T, (H + 2 Hk) D]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "cos and sin must be contiguous float32 [T, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == T, "slots: int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK_INDEX(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " out of range");
  auto run = [&](auto qkv_type, auto cache_type) {
    using Q = decltype(qkv_type);
    using C = decltype(cache_type);
    parallel_for(0, T, grain((H + Hk) * D * 4), [&](int64_t t0, int64_t t1) {
      rope_rows<Q, C>(qkv.data_ptr<Q>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<C>(),
                      v_cache.data_ptr<C>(), sp, t0, t1, H, Hk, D);
    });
  };
  using B = at::BFloat16;
  if (dt == torch::kFloat32)
    ct == torch::kFloat32 ? run(float(), float()) : ct == torch::kFloat16 ? run(float(), at::Half()) : run(float(), B());
  else
    ct == torch::kFloat16 ? run(B(), at::Half()) : run(B(), B());
}

}  // namespace wsq
