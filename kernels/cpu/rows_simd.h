// The bf16 row ops of fvec.h (SiLU(gate) * up, RMSNorm with the residual add), written once for
// both vector ISAs; included after attention_simd.h, with `struct FV` (div, round_bf16,
// store_bf16 beside the ops listed there). Scalar tails (rows not a multiple of L) round alike.
#pragma once

WSQ_TARGET void silu_rows(const uint16_t* x, uint16_t* out, int64_t m0, int64_t m1, int64_t d) {
  constexpr int L = FV::L;
  const typename FV::VF one = FV::set1(1.0f), zero = FV::zero();
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* g = x + m * 2 * d;
    const uint16_t* u = g + d;
    uint16_t* o = out + m * d;
    int64_t j = 0;
    for (; j + L <= d; j += L) {
      const typename FV::VF a = FV::load(g + j);
      const typename FV::VF s = FV::round_bf16(FV::div(a, FV::add(one, FV::exp(FV::sub(zero, a)))));
      FV::store_bf16(o + j, FV::round_bf16(FV::mul(s, FV::load(u + j))));
    }
    for (; j < d; ++j) {
      const float a = from_bf16(g[j]);
      o[j] = to_bf16(from_bf16(to_bf16(a / (1.0f + std::exp(-a)))) * from_bf16(u[j]));
    }
  }
}

// rows [m0, m1): h = x + res rounded (res may be null: h is x), out = w * (h * rsqrt(mean(h^2) + eps))
// with the normalised row rounded before the weight, as kernels/norms.py rounds.
WSQ_TARGET void norm_rows(const uint16_t* x, const uint16_t* res, const uint16_t* w, uint16_t* out, uint16_t* h,
                          int64_t m0, int64_t m1, int64_t K, float eps) {
  constexpr int L = FV::L;
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* xr = x + m * K;
    const uint16_t* hr = res != nullptr ? h + m * K : xr;
    typename FV::VF vss = FV::zero();
    float ss = 0.0f;
    int64_t j = 0;
    for (; j + L <= K; j += L) {
      typename FV::VF v = FV::load(xr + j);
      if (res != nullptr) {
        v = FV::round_bf16(FV::add(v, FV::load(res + m * K + j)));
        FV::store_bf16(h + m * K + j, v);
      }
      vss = FV::fmadd(v, v, vss);
    }
    for (; j < K; ++j) {
      float v = from_bf16(xr[j]);
      if (res != nullptr) {
        h[m * K + j] = to_bf16(v + from_bf16(res[m * K + j]));
        v = from_bf16(h[m * K + j]);
      }
      ss += v * v;
    }
    ss += FV::hsum(vss);
    const float r = 1.0f / std::sqrt(ss / float(K) + eps);
    const typename FV::VF vr = FV::set1(r);
    for (j = 0; j + L <= K; j += L)
      FV::store_bf16(out + m * K + j, FV::round_bf16(FV::mul(FV::load(w + j), FV::round_bf16(FV::mul(FV::load(hr + j), vr)))));
    for (; j < K; ++j) out[m * K + j] = to_bf16(from_bf16(w[j]) * from_bf16(to_bf16(from_bf16(hr[j]) * r)));
  }
}
