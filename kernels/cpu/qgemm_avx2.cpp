// The AVX2 path: `vpmaddubsw` (unsigned x signed bytes, pairs into int16) then `vpmaddwd`
// with ones (pairs into int32). No int16 saturation: the largest pair is 2 * 63 * 127 for
// the 4-, 5- and 6-bit formats and 2 * 128 * 127 for Q8_0 (signs moved onto x first).
#include <immintrin.h>

#include "qgemm.h"

#define WSQ_TARGET __attribute__((target("avx2,fma,f16c")))

namespace wsq {
namespace avx2 {

struct Vec {
  using V = __m256i;
  static constexpr int CH = 1;
  WSQ_TARGET static V load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  WSQ_TARGET static V zero() { return _mm256_setzero_si256(); }
  WSQ_TARGET static V dot(V acc, V u, V s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  WSQ_TARGET static V dot_s(V acc, V w, V s) { return dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }
  WSQ_TARGET static V lo4(V w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  WSQ_TARGET static V hi4(V w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  WSQ_TARGET static V or_(V a, V b) { return _mm256_or_si256(a, b); }
  WSQ_TARGET static V bits(V h, int shift, int mask) {
    const V v = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
    return _mm256_slli_epi16(v, 4);
  }
  WSQ_TARGET static __m256i fold(V acc) { return acc; }
};

#include "qgemm_simd.h"

}  // namespace avx2

const GroupFn* kernels_avx2() { return avx2::kTable; }

}  // namespace wsq
