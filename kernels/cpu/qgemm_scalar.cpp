// The scalar path: plain C++ over the packed layout, for CPUs without AVX2 and as the
// readable statement of what the vector paths compute. Same integers, same float order.
#include <cstring>

#include "qgemm.h"

namespace wsq {
namespace {

// fp16 bits -> float, exact (F16C is not assumed here).
inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float f = float(man) * 5.9604644775390625e-08f;  // man * 2**-24: subnormal or zero, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP4's exponent byte as its float scale (qgemm.h: e8m0_half_bits).
inline float e8m0f(uint8_t e) {
  const uint32_t bits = e8m0_half_bits(e);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Byte e of row r in a field stored as units of 4 bytes per row.
inline uint8_t ub(const uint8_t* field, int r, int e) { return field[(e >> 2) * kUnit + r * 4 + (e & 3)]; }

template <int QT>
int32_t block_int(const uint8_t* blk, int r, const int8_t* x, const int32_t* s16, int32_t* msum) {
  constexpr Off o = offsets(QT);
  int32_t sumi = 0;
  if (QT == Q4_0 || QT == Q4_1) {
    for (int l = 0; l < 16; ++l) sumi += (ub(blk + o.qs, r, l) & 15) * x[l] + (ub(blk + o.qs, r, l) >> 4) * x[16 + l];
    if (QT == Q4_0) sumi -= 8 * (s16[0] + s16[1]);
  } else if (QT == Q8_0) {
    for (int l = 0; l < 32; ++l) sumi += int8_t(ub(blk + o.qs, r, l)) * x[l];
  } else if (QT == MXFP4) {
    for (int l = 0; l < 16; ++l)
      sumi += kMxfp4Values[ub(blk + o.qs, r, l) & 15] * x[l] + kMxfp4Values[ub(blk + o.qs, r, l) >> 4] * x[16 + l];
  } else if (QT == Q4_K || QT == Q5_K) {
    *msum = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = ub(blk + o.qs, r, (j >> 1) * 32 + l);
        int q = (j & 1) ? byte >> 4 : byte & 15;
        if (QT == Q5_K) q |= ((ub(blk + o.qh, r, l) >> j) & 1) << 4;
        dot += q * x[j * 32 + l];
      }
      sumi += blk[o.sc + j * kRows + r] * dot;
      *msum += blk[o.mn + j * kRows + r] * (s16[2 * j] + s16[2 * j + 1]);
    }
  } else {  // Q6_K
    for (int jj = 0; jj < 16; ++jj) {
      const int h = jj >> 3, t = (jj & 7) >> 1, half = jj & 1;
      int32_t dot = 0;
      for (int l = half * 16; l < half * 16 + 16; ++l) {
        const uint8_t lo = ub(blk + o.qs, r, h * 64 + (t & 1) * 32 + l);
        const int q = ((t >= 2 ? lo >> 4 : lo & 15) | (((ub(blk + o.qh, r, h * 32 + l) >> (2 * t)) & 3) << 4));
        dot += q * x[h * 128 + t * 32 + l];
      }
      sumi += int8_t(blk[o.sc + jj * kRows + r]) * (dot - 32 * s16[jj]);
    }
  }
  return sumi;
}

template <int QT>
void group_kernel(const uint8_t* g, const Act& a, int m0, int mt, float* out) {
  constexpr int BV = block_values(QT), PB = packed_bytes(QT);
  constexpr Off o = offsets(QT);
  for (int i = 0; i < mt * kRows; ++i) out[i] = 0.0f;
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * PB;
    for (int r = 0; r < kRows; ++r) {
      const float dw = QT == MXFP4 ? e8m0f(blk[o.d + r]) : h2f(blk + o.d + 2 * r);
      const float mw = o.m >= 0 ? h2f(blk + o.m + 2 * r) : 0.0f;
      for (int i = 0; i < mt; ++i) {
        const float dx = a.dx(m0 + i)[b];
        const int32_t* s16 = a.sums(m0 + i) + b * (BV / 16);
        int32_t msum = 0;
        const int32_t sumi = block_int<QT>(blk, r, a.qrow(m0 + i) + (size_t)b * BV, s16, &msum);
        float t = (dw * dx) * float(sumi);
        if (QT == Q4_1) t = t + (mw * dx) * float(s16[0] + s16[1]);
        if (QT == Q4_K || QT == Q5_K) t = t - (mw * dx) * float(msum);
        out[i * kRows + r] = out[i * kRows + r] + t;
      }
    }
  }
}

// Row r of a group, dequantized in gguf.quants' order of float operations (bit-equal).
template <int QT>
void dequant(const uint8_t* g, int nb, int r, float* out) {
  constexpr int BV = block_values(QT), PB = packed_bytes(QT);
  constexpr Off o = offsets(QT);
  for (int b = 0; b < nb; ++b, out += BV) {
    const uint8_t* blk = g + (size_t)b * PB;
    const float d = QT == MXFP4 ? e8m0f(blk[o.d + r]) : h2f(blk + o.d + 2 * r);
    if (QT == MXFP4) {
      for (int l = 0; l < 16; ++l) {
        out[l] = d * float(kMxfp4Values[ub(blk + o.qs, r, l) & 15]);
        out[16 + l] = d * float(kMxfp4Values[ub(blk + o.qs, r, l) >> 4]);
      }
    } else if (QT == Q8_0) {
      for (int l = 0; l < 32; ++l) out[l] = float(int8_t(ub(blk + o.qs, r, l))) * d;
    } else if (QT == Q4_0 || QT == Q4_1) {
      const float m = QT == Q4_1 ? h2f(blk + o.m + 2 * r) : 0.0f;
      for (int l = 0; l < 16; ++l) {
        const int lo = ub(blk + o.qs, r, l) & 15, hi = ub(blk + o.qs, r, l) >> 4;
        out[l] = QT == Q4_0 ? d * float(lo - 8) : (d * float(lo)) + m;
        out[16 + l] = QT == Q4_0 ? d * float(hi - 8) : (d * float(hi)) + m;
      }
    } else if (QT == Q4_K || QT == Q5_K) {
      const float dmin = h2f(blk + o.m + 2 * r);
      for (int j = 0; j < 8; ++j) {
        const float ds = d * float(blk[o.sc + j * kRows + r]), dm = dmin * float(blk[o.mn + j * kRows + r]);
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = ub(blk + o.qs, r, (j >> 1) * 32 + l);
          int q = (j & 1) ? byte >> 4 : byte & 15;
          if (QT == Q5_K) q |= ((ub(blk + o.qh, r, l) >> j) & 1) << 4;
          out[j * 32 + l] = ds * float(q) - dm;
        }
      }
    } else {  // Q6_K
      for (int jj = 0; jj < 16; ++jj) {
        const int h = jj >> 3, t = (jj & 7) >> 1, half = jj & 1;
        const float ds = d * float(int8_t(blk[o.sc + jj * kRows + r]));
        for (int l = half * 16; l < half * 16 + 16; ++l) {
          const uint8_t lo = ub(blk + o.qs, r, h * 64 + (t & 1) * 32 + l);
          const int q = (t >= 2 ? lo >> 4 : lo & 15) | (((ub(blk + o.qh, r, h * 32 + l) >> (2 * t)) & 3) << 4);
          out[h * 128 + t * 32 + l] = ds * float(q - 32);
        }
      }
    }
  }
}

const GroupFn kTable[kNumQTypes] = {group_kernel<Q4_0>, group_kernel<Q4_1>, group_kernel<Q8_0>, group_kernel<Q4_K>,
                                    group_kernel<Q5_K>, group_kernel<Q6_K>, group_kernel<MXFP4>};

}  // namespace

const GroupFn* kernels_scalar() { return kTable; }

void dequant_row(int qt, const uint8_t* group, int nb, int r, float* out) {
  using Fn = void (*)(const uint8_t*, int, int, float*);
  static const Fn table[kNumQTypes] = {dequant<Q4_0>, dequant<Q4_1>, dequant<Q8_0>, dequant<Q4_K>,
                                       dequant<Q5_K>, dequant<Q6_K>, dequant<MXFP4>};
  table[qt](group, nb, r, out);
}

}  // namespace wsq
