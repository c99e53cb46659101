// The decode attention of attention.h, written once for both vector ISAs. Included by
// fvec_avx512.cpp and fvec_avx2.cpp (after <cmath>) inside their own namespace after they define WSQ_TARGET
// and `struct FV` (L float lanes: load(float*), load(uint16_t*) (bf16 bits), load(f16*) (half
// bits), store, set1, zero, add, sub, mul, fmadd(a, b, c) = a * b + c, max, hsum, hmax, exp).
// T: q's and out's element type (float or bf16 bits); C: the caches' (float, bf16 or f16 bits:
// a half cache under a float32 model is widened exactly as it is loaded).
//
// Per (sequence, kv head): the scores of its G query heads (up to 4 at a time, sharing each key
// and value row read) against every context position it sees (its window's), read from the cache
// through the block table, soft-capped if the layer caps them; softmax in float32 with a vector
// exp, the sinks in its max and sum; then the weighted sum of the value rows, a few vectors of D
// at a time in registers. FV also gives kValueChunk (value vectors per pass).
#pragma once

template <class T>
WSQ_TARGET inline void load_scaled(const T* src, float scale, int D, float* dst) {
  const typename FV::VF s = FV::set1(scale);
  for (int j = 0; j < D; j += FV::L) FV::store(dst + j, FV::mul(FV::load(src + j), s));
}

// The rows of a few positions ahead are asked for early: each row is D values of one kv head,
// strided by the others' within a block and scattered across blocks, which the hardware's
// prefetchers do not follow. off: each position's row offset in the cache (rows_of).
constexpr int kAhead = 4;
template <class T>
WSQ_TARGET inline void prefetch_row(const DecodeArgs& a, const T* cache, const int64_t* off, int p, int len) {
  if (p >= len) return;
  const char* r = reinterpret_cast<const char*>(cache + off[p]);
  for (int b = 0; b < a.D * int(sizeof(T)); b += 64) __builtin_prefetch(r + b);
}

// off[p - lo] = element offset of position p's row of kv head hk for p in [lo, len), walking the
// table block by block from lo's (no division per position; the blocks before lo are not read)
WSQ_TARGET inline void rows_of(const DecodeArgs& a, const int32_t* table, int hk, int lo, int len, int64_t* off) {
  const int64_t row = int64_t(a.Hk) * a.D;
  for (int p0 = lo - lo % a.bs, b = lo / a.bs; p0 < len; p0 += a.bs, ++b) {
    const int64_t base = int64_t(table[b]) * a.bs * row + int64_t(hk) * a.D;
    const int n = len - p0 < a.bs ? len - p0 : a.bs;
    for (int i = p0 < lo ? lo - p0 : 0; i < n; ++i) off[p0 + i - lo] = base + i * row;
  }
}

// Scores of GC query heads (qf: GC rows of D, scaled) against positions [0, len): each key row
// is loaded and widened once for the GC heads. w: GC rows, ws apart; mx: each head's max.
template <int GC, class C>
WSQ_TARGET void scores(const DecodeArgs& a, const C* k, const int64_t* off, int len, const float* qf,
                       float* w, int64_t ws, float* mx) {
  const int nv = a.D / FV::L;
  for (int g = 0; g < GC; ++g) mx[g] = -INFINITY;
  for (int p = 0; p < kAhead; ++p) prefetch_row(a, k, off, p, len);
  for (int p = 0; p < len; ++p) {
    prefetch_row(a, k, off, p + kAhead, len);
    const C* kr = k + off[p];
    typename FV::VF acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = FV::zero();
    for (int c = 0; c < nv; ++c) {
      const typename FV::VF kv = FV::load(kr + c * FV::L);
      for (int g = 0; g < GC; ++g) acc[g] = FV::fmadd(FV::load(qf + g * a.D + c * FV::L), kv, acc[g]);
    }
    for (int g = 0; g < GC; ++g) {
      float sc = FV::hsum(acc[g]);
      if (a.softcap > 0.0f) sc = a.softcap * std::tanh(sc / a.softcap);
      w[g * ws + p] = sc;
      mx[g] = sc > mx[g] ? sc : mx[g];
    }
  }
}

// out (GC heads, D apart) columns [c0, c0 + NC * L) = sum over p of w[p] * value row p, times inv;
// each value row is loaded once for the GC heads.
template <int GC, int NC, class C, class T>
WSQ_TARGET void weighted(const DecodeArgs& a, const C* v, const int64_t* off, int len, const float* w,
                         int64_t ws, const float* inv, int c0, T* out) {
  typename FV::VF acc[GC][NC];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = FV::zero();
  for (int p = 0; p < kAhead; ++p) prefetch_row(a, v, off, p, len);
  for (int p = 0; p < len; ++p) {
    prefetch_row(a, v, off, p + kAhead, len);
    const C* vr = v + off[p] + c0;
    typename FV::VF vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = FV::load(vr + c * FV::L);
    for (int g = 0; g < GC; ++g) {
      const typename FV::VF wp = FV::set1(w[g * ws + p]);
      for (int c = 0; c < NC; ++c) acc[g][c] = FV::fmadd(wp, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NC; ++c) {
      float tmp[FV::L];
      FV::store(tmp, FV::mul(acc[g][c], FV::set1(inv[g])));
      T* o = out + g * a.D + c0 + c * FV::L;
      for (int l = 0; l < FV::L; ++l) o[l] = narrow<T>(tmp[l]);
    }
}

// Query heads h0 .. h0 + GC - 1 of sequence s, all on kv head hk; off: its `len` positions seen.
// A sink is one more score whose value row is zero: in the max and the sum, nowhere else.
template <int GC, class T, class C>
WSQ_TARGET void heads(const DecodeArgs& a, int64_t s, int h0, int len, const int64_t* off, float* scratch) {
  const T* q = static_cast<const T*>(a.q);
  const int D = a.D, nv = D / FV::L;
  const int64_t ws = len + 16;
  float* qf = scratch;           // GC rows of D: the scaled queries
  float* w = scratch + GC * D;   // GC rows of ws: scores, then unnormalised weights
  for (int g = 0; g < GC; ++g) load_scaled(q + s * a.q_stride + int64_t(h0 + g) * D, a.scale, D, qf + g * D);
  float mx[GC], inv[GC];
  scores<GC>(a, static_cast<const C*>(a.k), off, len, qf, w, ws, mx);
  if (a.sinks)
    for (int g = 0; g < GC; ++g) mx[g] = a.sinks[h0 + g] > mx[g] ? a.sinks[h0 + g] : mx[g];
  for (int g = 0; g < GC; ++g) {
    float* wg = w + g * ws;
    const typename FV::VF vmx = FV::set1(mx[g]);
    typename FV::VF vsum = FV::zero();
    int p = 0;
    for (; p + FV::L <= len; p += FV::L) {
      const typename FV::VF e = FV::exp(FV::sub(FV::load(wg + p), vmx));
      FV::store(wg + p, e);
      vsum = FV::add(vsum, e);
    }
    float sum = FV::hsum(vsum);
    for (; p < len; ++p) sum += (wg[p] = std::exp(wg[p] - mx[g]));
    if (a.sinks) sum += std::exp(a.sinks[h0 + g] - mx[g]);
    inv[g] = 1.0f / sum;
  }
  const C* v = static_cast<const C*>(a.v);
  T* out = static_cast<T*>(a.out) + s * int64_t(a.H) * D + int64_t(h0) * D;
  constexpr int NC = FV::kValueChunk;  // value vectors per pass: GC * NC accumulators fit the registers
  int c = 0;
  for (; c + NC <= nv; c += NC) weighted<GC, NC>(a, v, off, len, w, ws, inv, c * FV::L, out);
  for (; c < nv; ++c) weighted<GC, 1>(a, v, off, len, w, ws, inv, c * FV::L, out);
}

template <class T, class C>
WSQ_TARGET void decode_items_t(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  const int G = a.H / a.Hk;
  int64_t* off = reinterpret_cast<int64_t*>(scratch);  // decode_scratch_floats: 2 floats a position
  float* rest = scratch + 2 * (a.width * a.bs);
  for (int64_t item = item0; item < item1; ++item) {
    const int64_t s = item / a.Hk;
    const int hk = int(item % a.Hk), len = a.lens[s], lo = first_seen(a, len);
    rows_of(a, a.tables + s * a.width, hk, lo, len, off);
    for (int g0 = 0; g0 < G; g0 += 4) {  // up to 4 query heads share each key and value row read
      const int h0 = hk * G + g0;
      switch (G - g0 < 4 ? G - g0 : 4) {
        case 4: heads<4, T, C>(a, s, h0, len - lo, off, rest); break;
        case 3: heads<3, T, C>(a, s, h0, len - lo, off, rest); break;
        case 2: heads<2, T, C>(a, s, h0, len - lo, off, rest); break;
        default: heads<1, T, C>(a, s, h0, len - lo, off, rest);
      }
    }
  }
}

// The pairs attention.cpp lets through: q float32 over any cache, q bf16 over a bf16 or f16 one.
WSQ_TARGET void decode_items(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch) {
  if (a.q_type == kBF16)
    return a.kv_type == kF16 ? decode_items_t<uint16_t, f16>(a, item0, item1, scratch)
                             : decode_items_t<uint16_t, uint16_t>(a, item0, item1, scratch);
  switch (a.kv_type) {
    case kBF16: return decode_items_t<float, uint16_t>(a, item0, item1, scratch);
    case kF16: return decode_items_t<float, f16>(a, item0, item1, scratch);
    default: return decode_items_t<float, float>(a, item0, item1, scratch);
  }
}
