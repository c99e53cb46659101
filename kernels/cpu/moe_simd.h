// The router's dot products (moe.h: RouterFn) written once for both vector ISAs: included by
// fvec_avx512.cpp and fvec_avx2.cpp after `struct FV`. Per expert, its weight row's vectors are
// loaded once for up to 4 rows of x, each row summing into its own accumulators (4 vectors, so
// the adds of one row do not wait on each other), reduced in a fixed order at the end.
#pragma once

template <int MT>
WSQ_TARGET inline void router_tile(const float* x, const float* w, int64_t H, float* out, int64_t E) {
  constexpr int L = FV::L;
  typename FV::VF acc[MT][4];
  for (int i = 0; i < MT; ++i)
    for (int a = 0; a < 4; ++a) acc[i][a] = FV::zero();
  int64_t j = 0;
  for (; j + 4 * L <= H; j += 4 * L)
    for (int a = 0; a < 4; ++a) {
      const typename FV::VF wv = FV::load(w + j + a * L);
      for (int i = 0; i < MT; ++i) acc[i][a] = FV::fmadd(FV::load(x + i * H + j + a * L), wv, acc[i][a]);
    }
  for (; j + L <= H; j += L) {
    const typename FV::VF wv = FV::load(w + j);
    for (int i = 0; i < MT; ++i) acc[i][0] = FV::fmadd(FV::load(x + i * H + j), wv, acc[i][0]);
  }
  for (int i = 0; i < MT; ++i) {
    float s = FV::hsum(FV::add(FV::add(acc[i][0], acc[i][1]), FV::add(acc[i][2], acc[i][3])));
    for (int64_t r = j; r < H; ++r) s += x[i * H + r] * w[r];
    out[i * E] = s;
  }
}

WSQ_TARGET void router_logits(const float* x, const float* w, int64_t T, int64_t e0, int64_t e1, int64_t H, int64_t E,
                              float* out) {
  for (int64_t e = e0; e < e1; ++e) {
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) router_tile<4>(x + t * H, w + e * H, H, out + t * E + e, E);
    for (; t < T; ++t) router_tile<1>(x + t * H, w + e * H, H, out + t * E + e, E);
  }
}
