// The LoRA row (lora.h) written once for both vector ISAs: included by fvec_avx512.cpp and
// fvec_avx2.cpp after rows_simd.h (whose round_to / store_as it uses), with `struct FV`.
// T: float or uint16_t (bf16 bits). Scalar tails (K or n not a multiple of L) use fmaf in the
// same order as the lanes would, so a row's bits never depend on its batch.
#pragma once

template <class T>
WSQ_TARGET void lora_row_t(const LoraPiece& p, const void* xv, void* yv, int64_t N, int64_t m) {
  using VF = typename FV::VF;
  constexpr int L = FV::L;
  const T* x = static_cast<const T*>(xv) + m * p.K;
  T* y = static_cast<T*>(yv) + m * N + p.offset;
  float t[kMaxLoraRank];
  const int kv = p.K - p.K % L;
  int j = 0;
  for (; j + 4 <= p.r; j += 4) {  // shrink: 4 rows of A per load of x
    const float* a = p.a + int64_t(j) * p.K;
    VF s0 = FV::zero(), s1 = FV::zero(), s2 = FV::zero(), s3 = FV::zero();
    for (int k = 0; k < kv; k += L) {
      const VF xk = FV::load(x + k);
      s0 = FV::fmadd(xk, FV::load(a + k), s0);
      s1 = FV::fmadd(xk, FV::load(a + p.K + k), s1);
      s2 = FV::fmadd(xk, FV::load(a + 2 * p.K + k), s2);
      s3 = FV::fmadd(xk, FV::load(a + 3 * p.K + k), s3);
    }
    float r0 = FV::hsum(s0), r1 = FV::hsum(s1), r2 = FV::hsum(s2), r3 = FV::hsum(s3);
    for (int k = kv; k < p.K; ++k) {
      const float xk = widen(x[k]);
      r0 = std::fmaf(xk, a[k], r0);
      r1 = std::fmaf(xk, a[p.K + k], r1);
      r2 = std::fmaf(xk, a[2 * p.K + k], r2);
      r3 = std::fmaf(xk, a[3 * p.K + k], r3);
    }
    t[j] = r0, t[j + 1] = r1, t[j + 2] = r2, t[j + 3] = r3;
  }
  for (; j < p.r; ++j) {
    const float* a = p.a + int64_t(j) * p.K;
    VF s = FV::zero();
    for (int k = 0; k < kv; k += L) s = FV::fmadd(FV::load(x + k), FV::load(a + k), s);
    float r = FV::hsum(s);
    for (int k = kv; k < p.K; ++k) r = std::fmaf(widen(x[k]), a[k], r);
    t[j] = r;
  }
  int c = 0;
  for (; c + 2 * L <= p.n; c += 2 * L) {  // expand: two vectors of columns per pass over t
    VF u0 = FV::zero(), u1 = FV::zero();
    for (int i = 0; i < p.r; ++i) {
      const VF ti = FV::set1(t[i]);
      const float* b = p.bt + int64_t(i) * p.n + c;
      u0 = FV::fmadd(ti, FV::load(b), u0);
      u1 = FV::fmadd(ti, FV::load(b + L), u1);
    }
    store_as(y + c, round_to<T>(FV::add(FV::load(y + c), u0)));
    store_as(y + c + L, round_to<T>(FV::add(FV::load(y + c + L), u1)));
  }
  for (; c + L <= p.n; c += L) {
    VF u = FV::zero();
    for (int i = 0; i < p.r; ++i) u = FV::fmadd(FV::set1(t[i]), FV::load(p.bt + int64_t(i) * p.n + c), u);
    store_as(y + c, round_to<T>(FV::add(FV::load(y + c), u)));
  }
  for (; c < p.n; ++c) {
    float u = 0.0f;
    for (int i = 0; i < p.r; ++i) u = std::fmaf(t[i], p.bt[int64_t(i) * p.n + c], u);
    y[c] = narrow<T>(widen(y[c]) + u);
  }
}

inline LoraRowFn lora_row(bool bf16) { return bf16 ? lora_row_t<uint16_t> : lora_row_t<float>; }
