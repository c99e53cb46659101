// The sampler's row passes of sample.h, written once for both vector ISAs; included in fvec_avx512.cpp
// and fvec_avx2.cpp after `struct FV` (with max, hmax, select_ge and the comparison bit masks ge_bits
// and eq_bits beside the ops attention_simd.h lists). Tails (rows not a multiple of L) are scalar.
#pragma once

#include <cmath>

WSQ_TARGET float sample_row_max(const float* l, int64_t V, bool* nan) {
  constexpr int L = FV::L;
  typename FV::VF m = FV::set1(-INFINITY);
  uint32_t bad = 0;
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const typename FV::VF v = FV::load(l + i);
    bad |= ~FV::eq_bits(v, v) & ((1u << L) - 1);  // NaN is the one value unequal to itself
    m = FV::max(m, v);
  }
  float mx = FV::hmax(m);
  for (; i < V; ++i) {
    bad |= l[i] != l[i];
    mx = l[i] > mx ? l[i] : mx;
  }
  *nan = bad != 0;
  return mx;
}

WSQ_TARGET int64_t sample_first_eq(const float* l, int64_t V, float v) {
  constexpr int L = FV::L;
  const typename FV::VF t = FV::set1(v);
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const uint32_t hit = FV::eq_bits(FV::load(l + i), t);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i)
    if (l[i] == v) return i;
  return V;
}

WSQ_TARGET float sample_exp_pass(const float* l, int64_t V, float T, float ms, float floor, float* e, float* chunk,
                                 int64_t chunk_len) {
  constexpr int L = FV::L;
  const typename FV::VF vt = FV::set1(T), vm = FV::set1(ms), lowest = FV::set1(kSampleMinExp),
                        vf = FV::set1(sample_floor(floor)), zero = FV::zero();
  float total = 0.0f;
  for (int64_t c0 = 0, c = 0; c0 < V; c0 += chunk_len, ++c) {
    const int64_t c1 = c0 + chunk_len < V ? c0 + chunk_len : V;
    typename FV::VF all = zero, kept = zero;
    int64_t i = c0;
    for (; i + L <= c1; i += L) {
      const typename FV::VF d = FV::sub(FV::div(FV::load(l + i), vt), vm);  // l / T - max, as l / T rounds
      const typename FV::VF x = FV::select_ge(d, lowest, FV::exp(d), zero);
      FV::store(e + i, x);
      all = FV::add(all, x);
      kept = FV::add(kept, FV::select_ge(x, vf, x, zero));
    }
    float a = FV::hsum(all), k = FV::hsum(kept);
    for (; i < c1; ++i) {
      const float d = l[i] / T - ms;
      e[i] = d >= kSampleMinExp ? std::exp(d) : 0.0f;
      a += e[i];
      k += e[i] >= sample_floor(floor) ? e[i] : 0.0f;
    }
    chunk[c] = k;
    total += a;
  }
  return total;
}

WSQ_TARGET int64_t sample_gather(const float* e, int64_t V, float lo, float hi, int32_t* idx) {
  constexpr int L = FV::L;
  const float lo1 = sample_floor(lo);
  const typename FV::VF vlo = FV::set1(lo1), vhi = FV::set1(hi);
  const uint32_t lanes = (1u << L) - 1;
  int64_t n = 0, i = 0;
  for (; i + L <= V; i += L) {
    const typename FV::VF v = FV::load(e + i);
    uint32_t hit = FV::ge_bits(v, vlo) & ~FV::ge_bits(v, vhi) & lanes;
    while (hit) {
      idx[n++] = int32_t(i + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
  for (; i < V; ++i)
    if (e[i] >= lo1 && e[i] < hi) idx[n++] = int32_t(i);
  return n;
}

// e / E where e is kept (>= floor and > 0), else -1
WSQ_TARGET inline typename FV::VF sample_ratio(const float* e, const float* E, int64_t i, typename FV::VF vf) {
  const typename FV::VF x = FV::load(e + i);
  return FV::select_ge(x, vf, FV::div(x, FV::load(E + i)), FV::set1(-1.0f));
}

WSQ_TARGET float sample_race_max(const float* e, const float* E, int64_t V, float floor) {
  constexpr int L = FV::L;
  const float f = sample_floor(floor);
  const typename FV::VF vf = FV::set1(f);
  typename FV::VF m = FV::set1(-1.0f);
  int64_t i = 0;
  for (; i + L <= V; i += L) m = FV::max(m, sample_ratio(e, E, i, vf));
  float mx = FV::hmax(m);
  for (; i < V; ++i) {
    const float r = e[i] >= f ? e[i] / E[i] : -1.0f;
    mx = r > mx ? r : mx;
  }
  return mx;
}

WSQ_TARGET int64_t sample_race_first(const float* e, const float* E, int64_t V, float floor, float v) {
  constexpr int L = FV::L;
  const float f = sample_floor(floor);
  const typename FV::VF vf = FV::set1(f), vv = FV::set1(v);
  int64_t i = 0;
  for (; i + L <= V; i += L) {
    const uint32_t hit = FV::eq_bits(sample_ratio(e, E, i, vf), vv);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i)
    if (e[i] >= f && e[i] / E[i] == v) return i;
  return V;
}

inline SampleFns sample_fns() {
  return {sample_row_max, sample_first_eq, sample_exp_pass, sample_gather, sample_race_max, sample_race_first};
}
