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

// Byte e of row r in a field stored as 32-byte units of 4 bytes per row.
inline uint8_t ub(const uint8_t* field, int r, int e) { return field[(e >> 2) * 32 + r * 4 + (e & 3)]; }

template <int QT>
int32_t block_int(const uint8_t* blk, int r, const int8_t* x, const int32_t* s16, int32_t* msum) {
  int32_t sumi = 0;
  if (QT == Q4_0 || QT == Q4_1) {
    const uint8_t* qs = blk + (QT == Q4_0 ? 16 : 32);
    for (int l = 0; l < 16; ++l) sumi += (ub(qs, r, l) & 15) * x[l] + (ub(qs, r, l) >> 4) * x[16 + l];
    if (QT == Q4_0) sumi -= 8 * (s16[0] + s16[1]);
  } else if (QT == Q8_0) {
    for (int l = 0; l < 32; ++l) sumi += int8_t(ub(blk + 16, r, l)) * x[l];
  } else if (QT == Q4_K || QT == Q5_K) {
    const uint8_t* sc = blk + 32;
    const uint8_t* mn = blk + 96;
    const uint8_t* qh = blk + 160;
    const uint8_t* qs = blk + (QT == Q4_K ? 160 : 416);
    *msum = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = ub(qs, r, (j >> 1) * 32 + l);
        int q = (j & 1) ? byte >> 4 : byte & 15;
        if (QT == Q5_K) q |= ((ub(qh, r, l) >> j) & 1) << 4;
        dot += q * x[j * 32 + l];
      }
      sumi += sc[j * 8 + r] * dot;
      *msum += mn[j * 8 + r] * (s16[2 * j] + s16[2 * j + 1]);
    }
  } else {  // Q6_K
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 16);
    const uint8_t* ql = blk + 144;
    const uint8_t* qh = blk + 1168;
    for (int jj = 0; jj < 16; ++jj) {
      const int h = jj >> 3, t = (jj & 7) >> 1, half = jj & 1;
      int32_t dot = 0;
      for (int l = half * 16; l < half * 16 + 16; ++l) {
        const uint8_t lo = ub(ql, r, h * 64 + (t & 1) * 32 + l);
        const int q = ((t >= 2 ? lo >> 4 : lo & 15) | (((ub(qh, r, h * 32 + l) >> (2 * t)) & 3) << 4));
        dot += q * x[h * 128 + t * 32 + l];
      }
      sumi += sc[jj * 8 + r] * (dot - 32 * s16[jj]);
    }
  }
  return sumi;
}

template <int QT>
void group_kernel(const uint8_t* g, const Act& a, int m0, int mt, float* out) {
  constexpr int BV = block_values(QT), PB = packed_bytes(QT);
  for (int i = 0; i < mt * kRows; ++i) out[i] = 0.0f;
  for (int b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + (size_t)b * PB;
    for (int r = 0; r < kRows; ++r) {
      const float dw = h2f(blk + 2 * r);
      const float mw = (QT == Q4_1 || QT == Q4_K || QT == Q5_K) ? h2f(blk + 16 + 2 * r) : 0.0f;
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

const GroupFn kTable[kNumQTypes] = {group_kernel<Q4_0>, group_kernel<Q4_1>, group_kernel<Q8_0>,
                                    group_kernel<Q4_K>, group_kernel<Q5_K>, group_kernel<Q6_K>};

}  // namespace

const GroupFn* kernels_scalar() { return kTable; }

}  // namespace wsq
