// The vector kernels, written once for both vector ISAs. Included by qgemm_avx2.cpp and
// qgemm_avx512.cpp inside their own namespace, after they define WSQ_TARGET (the function
// attribute that enables the ISA) and `struct Vec`:
//   Vec::V            an integer vector of CH 32-byte units (CH = 1: AVX2, 2: AVX-512)
//   load(p)           CH units of weights or expanded activations
//   dot(acc, u, s)    acc += per int32 lane, sum of 4 (unsigned byte u) * (signed byte s)
//   dot_s(acc, w, s)  the same with signed w (Q8_0)
//   lo4, hi4, or_, bits(h, shift, mask): ((h >> shift) & mask) << 4 per byte
//   fold(acc)         -> __m256i: the 8 rows' int32 sums (AVX-512 adds its two halves)
// A unit holds 4 bytes of each of the 8 rows of a group: lane r = row r. The activations'
// expanded form puts the same 4 quants in all 8 lanes, so a unit of weights times a unit
// of activations is 8 rows' partial dot products. The epilogue per block is 8-lane AVX2
// float code in the order of kernels/quant_ref.py (no FMA: -ffp-contract=off).
#pragma once

#define WSQ_X(a, m, chunk) Vec::load(reinterpret_cast<const uint8_t*>((a).xrow(m) + (size_t)(chunk) * 32))

template <int MT, int QT>
WSQ_TARGET void block32(const uint8_t* g, const Act& a, int m0, __m256* acc) {
  constexpr int PB = packed_bytes(QT), U = Vec::CH;
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * PB;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    typename Vec::V s[MT];
    for (int i = 0; i < MT; ++i) s[i] = Vec::zero();
    if (QT == Q8_0) {
      for (int t = 0; t < 8; t += U) {
        const auto w = Vec::load(blk + 16 + t * 32);
        for (int i = 0; i < MT; ++i) s[i] = Vec::dot_s(s[i], w, WSQ_X(a, m0 + i, b * 8 + t));
      }
    } else {
      const uint8_t* qs = blk + (QT == Q4_0 ? 16 : 32);
      for (int t = 0; t < 4; t += U) {
        const auto w = Vec::load(qs + t * 32);
        const auto lo = Vec::lo4(w), hi = Vec::hi4(w);
        for (int i = 0; i < MT; ++i) {
          s[i] = Vec::dot(s[i], lo, WSQ_X(a, m0 + i, b * 8 + t));
          s[i] = Vec::dot(s[i], hi, WSQ_X(a, m0 + i, b * 8 + t + 4));
        }
      }
    }
    const __m256 mw = QT == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)))
                                 : _mm256_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      const __m256 dx = _mm256_set1_ps(a.dx(m0 + i)[b]);
      const int32_t* s16 = a.sums(m0 + i) + b * 2;
      __m256i si = Vec::fold(s[i]);
      if (QT == Q4_0) si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * (s16[0] + s16[1])));
      __m256 t = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(si));
      if (QT == Q4_1)
        t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(float(s16[0] + s16[1]))));
      acc[i] = _mm256_add_ps(acc[i], t);
    }
  }
}

WSQ_TARGET inline __m256i scales8(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; pairs of sub-blocks share
// the bytes of qs (low nibbles: the first), Q5_K's fifth bits are bit j of qh for sub-block j.
template <int MT, int QT>
WSQ_TARGET void block_k45(const uint8_t* g, const Act& a, int m0, __m256* acc) {
  constexpr int PB = packed_bytes(QT), U = Vec::CH;
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * PB;
    const uint8_t* qh = blk + 160;
    const uint8_t* qs = blk + (QT == Q4_K ? 160 : 416);
    __m256i isum[MT];
    for (int i = 0; i < MT; ++i) isum[i] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      typename Vec::V s0[MT], s1[MT];
      for (int i = 0; i < MT; ++i) s0[i] = s1[i] = Vec::zero();
      for (int t = 0; t < 8; t += U) {
        const auto w = Vec::load(qs + (p * 8 + t) * 32);
        auto lo = Vec::lo4(w), hi = Vec::hi4(w);
        if (QT == Q5_K) {
          const auto h = Vec::load(qh + t * 32);
          lo = Vec::or_(lo, Vec::bits(h, 2 * p, 1));
          hi = Vec::or_(hi, Vec::bits(h, 2 * p + 1, 1));
        }
        for (int i = 0; i < MT; ++i) {
          s0[i] = Vec::dot(s0[i], lo, WSQ_X(a, m0 + i, b * 64 + p * 16 + t));
          s1[i] = Vec::dot(s1[i], hi, WSQ_X(a, m0 + i, b * 64 + p * 16 + 8 + t));
        }
      }
      const __m256i sc0 = scales8(blk + 32 + p * 16, false), sc1 = scales8(blk + 40 + p * 16, false);
      for (int i = 0; i < MT; ++i) {
        isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(sc0, Vec::fold(s0[i])));
        isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(sc1, Vec::fold(s1[i])));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int i = 0; i < MT; ++i) {
      const int32_t* s16 = a.sums(m0 + i) + b * 16;
      __m256i msum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        msum = _mm256_add_epi32(msum, _mm256_mullo_epi32(scales8(blk + 96 + j * 8, false),
                                                         _mm256_set1_epi32(s16[2 * j] + s16[2 * j + 1])));
      const __m256 dx = _mm256_set1_ps(a.dx(m0 + i)[b]);
      const __m256 t = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[i])),
                                     _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum)));
      acc[i] = _mm256_add_ps(acc[i], t);
    }
  }
}

// Q6_K: 16 groups of 16 with int8 scales; 4 low bits from ql, 2 high bits from qh (see
// quant_formats.quant_values), unsigned 0..63 here and the -32 taken out with the sums of x.
template <int MT>
WSQ_TARGET void block_q6k(const uint8_t* g, const Act& a, int m0, __m256* acc) {
  constexpr int PB = packed_bytes(Q6_K), U = Vec::CH;
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * PB;
    const uint8_t* ql = blk + 144;
    const uint8_t* qh = blk + 1168;
    __m256i isum[MT];
    for (int i = 0; i < MT; ++i) isum[i] = _mm256_setzero_si256();
    for (int jj = 0; jj < 16; ++jj) {
      const int h = jj >> 3, tq = (jj & 7) >> 1, half = jj & 1;
      typename Vec::V s[MT];
      for (int i = 0; i < MT; ++i) s[i] = Vec::zero();
      for (int t = 0; t < 4; t += U) {
        const int v = half * 4 + t;
        const auto wl = Vec::load(ql + (h * 16 + (tq & 1) * 8 + v) * 32);
        const auto q = Vec::or_(tq >= 2 ? Vec::hi4(wl) : Vec::lo4(wl), Vec::bits(Vec::load(qh + (h * 8 + v) * 32), 2 * tq, 3));
        for (int i = 0; i < MT; ++i) s[i] = Vec::dot(s[i], q, WSQ_X(a, m0 + i, b * 64 + h * 32 + tq * 8 + v));
      }
      const __m256i sc = scales8(blk + 16 + jj * 8, true);
      for (int i = 0; i < MT; ++i) {
        const __m256i d16 = _mm256_sub_epi32(Vec::fold(s[i]), _mm256_set1_epi32(32 * a.sums(m0 + i)[b * 16 + jj]));
        isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(sc, d16));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    for (int i = 0; i < MT; ++i) {
      const __m256 dx = _mm256_set1_ps(a.dx(m0 + i)[b]);
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[i])));
    }
  }
}

template <int MT, int QT>
WSQ_TARGET void tile(const uint8_t* g, const Act& a, int m0, float* out) {
  __m256 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  if (QT == Q4_K || QT == Q5_K)
    block_k45<MT, QT>(g, a, m0, acc);
  else if (QT == Q6_K)
    block_q6k<MT>(g, a, m0, acc);
  else
    block32<MT, QT>(g, a, m0, acc);
  for (int i = 0; i < MT; ++i) _mm256_storeu_ps(out + i * kRows, acc[i]);
}

template <int QT>
WSQ_TARGET void group_kernel(const uint8_t* g, const Act& a, int m0, int mt, float* out) {
  static_assert(kMaxTile == 4, "one instance per tile height");
  switch (mt) {
    case 4: return tile<4, QT>(g, a, m0, out);
    case 3: return tile<3, QT>(g, a, m0, out);
    case 2: return tile<2, QT>(g, a, m0, out);
    default: return tile<1, QT>(g, a, m0, out);
  }
}

const GroupFn kTable[kNumQTypes] = {group_kernel<Q4_0>, group_kernel<Q4_1>, group_kernel<Q8_0>,
                                    group_kernel<Q4_K>, group_kernel<Q5_K>, group_kernel<Q6_K>};

#undef WSQ_X
