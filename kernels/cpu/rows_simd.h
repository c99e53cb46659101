// The row ops of fvec.h (SiLU(gate) * up, RMSNorm with the residual add) over float32 or bf16
// rows, written once for both vector ISAs; included after attention_simd.h, with `struct FV`
// (div, round_bf16, store_bf16 beside the ops listed there). T: float or uint16_t (bf16 bits);
// every rounding to T is a no-op for float. Scalar tails (rows not a multiple of L) round alike.
#pragma once

// v rounded to T's precision (still as float lanes), and a rounded v stored as T
template <class T>
WSQ_TARGET inline typename FV::VF round_to(typename FV::VF v) {
  if constexpr (sizeof(T) == 2)
    return FV::round_bf16(v);
  else
    return v;
}
template <class T>
WSQ_TARGET inline void store_as(T* p, typename FV::VF rounded) {
  if constexpr (sizeof(T) == 2)
    FV::store_bf16(p, rounded);
  else
    FV::store(p, rounded);
}
template <class T>
inline float round_scalar(float x) {
  return widen(narrow<T>(x));
}

template <class T>
WSQ_TARGET void silu_rows_t(const void* xv, void* outv, int64_t m0, int64_t m1, int64_t d) {
  constexpr int L = FV::L;
  const T* x = static_cast<const T*>(xv);
  T* out = static_cast<T*>(outv);
  const typename FV::VF one = FV::set1(1.0f), zero = FV::zero();
  for (int64_t m = m0; m < m1; ++m) {
    const T* g = x + m * 2 * d;
    const T* u = g + d;
    T* o = out + m * d;
    int64_t j = 0;
    for (; j + L <= d; j += L) {
      const typename FV::VF a = FV::load(g + j);
      const typename FV::VF s = round_to<T>(FV::div(a, FV::add(one, FV::exp(FV::sub(zero, a)))));
      store_as(o + j, round_to<T>(FV::mul(s, FV::load(u + j))));
    }
    for (; j < d; ++j) {
      const float a = widen(g[j]);
      o[j] = narrow<T>(round_scalar<T>(a / (1.0f + std::exp(-a))) * widen(u[j]));
    }
  }
}

// rows [m0, m1): h = x + res rounded (res may be null: h is x), out = w * (h * rsqrt(mean(h^2) + eps))
// with the normalised row rounded before the weight, as kernels/norms.py rounds.
template <class T>
WSQ_TARGET void norm_rows_t(const void* xv, const void* resv, const void* wv, void* outv, void* hv, int64_t m0,
                            int64_t m1, int64_t K, float eps) {
  constexpr int L = FV::L;
  const T* x = static_cast<const T*>(xv);
  const T* res = static_cast<const T*>(resv);
  const T* w = static_cast<const T*>(wv);
  T* out = static_cast<T*>(outv);
  T* h = static_cast<T*>(hv);
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * K;
    const T* hr = res != nullptr ? h + m * K : xr;
    typename FV::VF vss = FV::zero();
    float ss = 0.0f;
    int64_t j = 0;
    for (; j + L <= K; j += L) {
      typename FV::VF v = FV::load(xr + j);
      if (res != nullptr) {
        v = round_to<T>(FV::add(v, FV::load(res + m * K + j)));
        store_as(h + m * K + j, v);
      }
      vss = FV::fmadd(v, v, vss);
    }
    for (; j < K; ++j) {
      float v = widen(xr[j]);
      if (res != nullptr) {
        h[m * K + j] = narrow<T>(v + widen(res[m * K + j]));
        v = widen(h[m * K + j]);
      }
      ss += v * v;
    }
    ss += FV::hsum(vss);
    const float r = 1.0f / std::sqrt(ss / float(K) + eps);
    const typename FV::VF vr = FV::set1(r);
    for (j = 0; j + L <= K; j += L)
      store_as(out + m * K + j, round_to<T>(FV::mul(FV::load(w + j), round_to<T>(FV::mul(FV::load(hr + j), vr)))));
    for (; j < K; ++j) out[m * K + j] = narrow<T>(widen(w[j]) * round_scalar<T>(widen(hr[j]) * r));
  }
}

inline SiluFn silu_rows(bool bf16) { return bf16 ? silu_rows_t<uint16_t> : silu_rows_t<float>; }
inline NormFn norm_rows(bool bf16) { return bf16 ? norm_rows_t<uint16_t> : norm_rows_t<float>; }
