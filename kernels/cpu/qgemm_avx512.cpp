// The AVX-512 VNNI path: `vpdpbusd` (unsigned x signed bytes, 4 into each int32 lane, no
// saturation) on 64-byte vectors = two 32-byte units, whose halves are folded per block.
#include <immintrin.h>

#include "qgemm.h"

#define WSQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace wsq {
namespace avx512 {

struct Vec {
  using V = __m512i;
  static constexpr int CH = 2;
  WSQ_TARGET static V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  WSQ_TARGET static V zero() { return _mm512_setzero_si512(); }
  WSQ_TARGET static V dot(V acc, V u, V s) { return _mm512_dpbusd_epi32(acc, u, s); }
  WSQ_TARGET static V dot_s(V acc, V w, V s) {
    // |w| as unsigned bytes (-128 -> 128) and x negated where w < 0
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return dot(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
  }
  WSQ_TARGET static V lo4(V w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  WSQ_TARGET static V hi4(V w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  WSQ_TARGET static V or_(V a, V b) { return _mm512_or_si512(a, b); }
  WSQ_TARGET static V bits(V h, int shift, int mask) {
    const V v = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8(char(mask)));
    return _mm512_slli_epi16(v, 4);
  }
  WSQ_TARGET static __m256i fold(V acc) {
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  }
};

#include "qgemm_simd.h"

}  // namespace avx512

const GroupFn* kernels_avx512() { return avx512::kTable; }

}  // namespace wsq
