// SiLU(gate) * up over bf16 rows (fvec.h), written once for both vector ISAs; included after
// attention_simd.h, with `struct FV` (div, round_bf16, store_bf16 beside the ops listed there).
// A scalar tail (d not a multiple of L) takes std::exp and the same roundings.
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
