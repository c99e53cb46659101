// The decode attention of attention.h, written once for both vector ISAs. Included by
// fvec_avx512.cpp and fvec_avx2.cpp (after <cmath>) inside their own namespace after they define WSQ_TARGET
// and `struct FV` (L float lanes: load(float*), load(uint16_t*) (bf16 bits), store, set1,
// zero, add, sub, mul, fmadd(a, b, c) = a * b + c, max, hsum, hmax, exp).
//
// Per (sequence, kv head): the scores of its G query heads against every context position,
// read from the cache through the block table; softmax in float32 with a vector exp; then
// the weighted sum of the value rows, D / L vectors at a time in registers.
#pragma once

template <class T>
WSQ_TARGET inline void load_scaled(const T* src, float scale, int D, float* dst) {
  const typename FV::VF s = FV::set1(scale);
  for (int j = 0; j < D; j += FV::L) FV::store(dst + j, FV::mul(FV::load(src + j), s));
}

// out[c * L ...] = sum over p < len of w[p] * v row p, NC vectors of one head's D
template <int NC, class T>
WSQ_TARGET inline void weighted_rows(const DecodeArgs& a, const T* v, const int32_t* table, int hk, int len,
                                     const float* w, float inv_sum, int c0, T* out) {
  typename FV::VF acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = FV::zero();
  const int64_t row = int64_t(a.Hk) * a.D;
  for (int p = 0; p < len; ++p) {
    const T* vr = v + (int64_t(table[p / a.bs]) * a.bs + p % a.bs) * row + int64_t(hk) * a.D + c0;
    const typename FV::VF wp = FV::set1(w[p]);
    for (int c = 0; c < NC; ++c) acc[c] = FV::fmadd(wp, FV::load(vr + c * FV::L), acc[c]);
  }
  const typename FV::VF is = FV::set1(inv_sum);
  for (int c = 0; c < NC; ++c) {
    float tmp[FV::L];
    FV::store(tmp, FV::mul(acc[c], is));
    for (int l = 0; l < FV::L; ++l) {
      if constexpr (sizeof(T) == 2)
        out[c0 + c * FV::L + l] = to_bf16(tmp[l]);
      else
        out[c0 + c * FV::L + l] = tmp[l];
    }
  }
}

template <class T>
WSQ_TARGET void decode_items_t(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  using VF = typename FV::VF;
  constexpr int L = FV::L;
  const int G = a.H / a.Hk, D = a.D, nv = D / L;
  const int64_t row = int64_t(a.Hk) * D;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);
  float* qf = scratch;     // one query head, scaled, as float
  float* w = scratch + D;  // its scores, then its softmax weights (unnormalised)
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t s = item / a.Hk;
    const int hk = int(item % a.Hk), len = a.lens[s];
    const int32_t* table = a.tables + s * a.width;
    for (int g = 0; g < G; ++g) {
      const int h = hk * G + g;
      load_scaled(q + s * a.q_stride + int64_t(h) * D, a.scale, D, qf);
      float mx = -INFINITY;
      for (int p = 0; p < len; ++p) {
        const T* kr = k + (int64_t(table[p / a.bs]) * a.bs + p % a.bs) * row + int64_t(hk) * D;
        VF acc = FV::zero();
        for (int c = 0; c < nv; ++c) acc = FV::fmadd(FV::load(qf + c * L), FV::load(kr + c * L), acc);
        w[p] = FV::hsum(acc);
        mx = w[p] > mx ? w[p] : mx;
      }
      const VF vmx = FV::set1(mx);
      VF vsum = FV::zero();
      int p = 0;
      for (; p + L <= len; p += L) {
        const VF e = FV::exp(FV::sub(FV::load(w + p), vmx));
        FV::store(w + p, e);
        vsum = FV::add(vsum, e);
      }
      float sum = FV::hsum(vsum);
      for (; p < len; ++p) {
        w[p] = std::exp(w[p] - mx);
        sum += w[p];
      }
      T* o = out + s * int64_t(a.H) * D + int64_t(h) * D;
      const float inv = 1.0f / sum;
      int c0 = 0;
      for (; c0 + 4 <= nv; c0 += 4) weighted_rows<4>(a, v, table, hk, len, w, inv, c0 * L, o);
      switch (nv - c0) {
        case 3: weighted_rows<3>(a, v, table, hk, len, w, inv, c0 * L, o); break;
        case 2: weighted_rows<2>(a, v, table, hk, len, w, inv, c0 * L, o); break;
        case 1: weighted_rows<1>(a, v, table, hk, len, w, inv, c0 * L, o); break;
        default: break;
      }
    }
  }
}

WSQ_TARGET void decode_items(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  if (a.bf16)
    decode_items_t<uint16_t>(a, item0, item1, scratch);
  else
    decode_items_t<float>(a, item0, item1, scratch);
}
