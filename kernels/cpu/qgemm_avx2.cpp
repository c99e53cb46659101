// The AVX2 path: `vpmaddubsw` (unsigned x signed bytes, pairs into int16) then `vpmaddwd`
// with ones (pairs into int32). No int16 saturation: the largest pair is 2 * 63 * 127 for
// the 4-, 5- and 6-bit formats and 2 * 128 * 127 for Q8_0 (signs moved onto x first).
// A group's 16 rows are two vectors of 8 lanes.
#include <immintrin.h>

#include <cstring>

#include "qgemm.h"

#define WSQ_TARGET __attribute__((target("avx2,fma,f16c")))

namespace wsq {
namespace avx2 {

struct Vec {
  using VI = __m256i;
  using VF = __m256;
  static constexpr int L = 8;
  // x rows per tile (what 16 registers hold: Q4_K and Q5_K keep two int16 sums and one int32 per row)
  static constexpr int tile(int qt) { return qt == Q4_K || qt == Q5_K ? 2 : 4; }
  static constexpr bool kQ8Offset = false;  // vpmaddubsw's int16 pairs would saturate at 255 * 127 * 2
  WSQ_TARGET static VI flip(VI w) { return w; }
  WSQ_TARGET static VI load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  WSQ_TARGET static VI bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  WSQ_TARGET static VI zero() { return _mm256_setzero_si256(); }
  WSQ_TARGET static VI dot(VI acc, VI u, VI s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  // 4 * 63 * 127 < 2**15: two vpmaddubsw results add in int16 before one vpmaddwd
  WSQ_TARGET static VI dot2(VI acc, VI u1, VI s1, VI u2, VI s2) {
    const VI pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  WSQ_TARGET static VI dot_s(VI acc, VI w, VI s) { return dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }
  WSQ_TARGET static VI lo4(VI w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  WSQ_TARGET static VI hi4(VI w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  WSQ_TARGET static VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  WSQ_TARGET static VI bits(VI h, int shift, int mask) {
    const VI v = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
    return _mm256_slli_epi16(v, 4);
  }
  WSQ_TARGET static VI shl16(VI v, int n) { return _mm256_slli_epi16(v, n); }
  WSQ_TARGET static VI shr16(VI v, int n) { return _mm256_srli_epi16(v, n); }
  WSQ_TARGET static VI and8(VI v, int m) { return _mm256_and_si256(v, _mm256_set1_epi8(char(m))); }
  WSQ_TARGET static VI mxfp4(VI nibbles) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Plus12));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nibbles);
  }
  WSQ_TARGET static VF e8m0(const uint8_t* p) {  // 2 ** (e - 128), as e8m0_half_bits
    const VI e = u8(p);
    const VI normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const VI tiny = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(1)), 21);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
  WSQ_TARGET static VI u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static VI s8(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static VF f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static VI pairs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
  WSQ_TARGET static VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
  WSQ_TARGET static VI madd16(VI a, VI b) { return _mm256_madd_epi16(a, b); }
  WSQ_TARGET static __m128i bytes8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  WSQ_TARGET static VI scale16u(const uint8_t* p) {
    const __m128i v = bytes8(p);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
  }
  WSQ_TARGET static VI scale16s(const uint8_t* p) {
    const __m128i v = bytes8(p);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, v));
  }
  WSQ_TARGET static VI pair16u(const uint8_t* a, const uint8_t* b) {
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes8(a), bytes8(b)));
  }
  WSQ_TARGET static VI pair16s(const uint8_t* a, const uint8_t* b) {
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(bytes8(a), bytes8(b)));
  }
  WSQ_TARGET static VI shl32(VI v, int n) { return _mm256_slli_epi32(v, n); }
  WSQ_TARGET static VI add(VI a, VI b) { return _mm256_add_epi32(a, b); }
  WSQ_TARGET static VI sub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
  WSQ_TARGET static VI mullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  WSQ_TARGET static VI set1(int32_t v) { return _mm256_set1_epi32(v); }
  WSQ_TARGET static VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
  WSQ_TARGET static VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  WSQ_TARGET static VF fadd(VF a, VF b) { return _mm256_add_ps(a, b); }
  WSQ_TARGET static VF fsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
  WSQ_TARGET static VF fset1(float v) { return _mm256_set1_ps(v); }
  WSQ_TARGET static VF fzero() { return _mm256_setzero_ps(); }
  WSQ_TARGET static void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
  // activation quantization (quantize_rows in qgemm_simd.h)
  WSQ_TARGET static VF fload(const float* p) { return _mm256_loadu_ps(p); }
  WSQ_TARGET static VF fload(const uint16_t* p) {  // bf16 -> float, exact
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  WSQ_TARGET static VF fabs_(VF v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  WSQ_TARGET static VF fmax_(VF a, VF b) { return _mm256_max_ps(a, b); }
  WSQ_TARGET static float hmax(VF v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  WSQ_TARGET static VI round_clamp(VF v) {  // nearest even (the default MXCSR mode), then +-127
    const VI q = _mm256_cvtps_epi32(v);
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
  }
  WSQ_TARGET static void store_q8(int8_t* p, VI v) {
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
  }
  WSQ_TARGET static int32_t hsum(VI v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
};

#include "qgemm_simd.h"

}  // namespace avx2

const GroupFn* kernels_avx2() { return avx2::kTable; }
QuantizeFn quantizer_avx2() { return avx2::quantize_rows; }

}  // namespace wsq
