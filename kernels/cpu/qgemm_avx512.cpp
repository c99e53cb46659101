// The AVX-512 VNNI path: `vpdpbusd` (unsigned x signed bytes, 4 into each int32 lane, no
// saturation) on 64-byte vectors: one vector is a unit, the 16 rows of a group.
#include <immintrin.h>

#include <cstring>

#include "qgemm.h"

#define WSQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace wsq {
namespace avx512 {

struct Vec {
  using VI = __m512i;
  using VF = __m512;
  static constexpr int L = 16;
  static constexpr int tile(int) { return 4; }
  static constexpr bool kQ8Offset = true;  // vpdpbusd adds without saturating (qgemm_simd.h)
  WSQ_TARGET static VI flip(VI w) { return _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))); }
  WSQ_TARGET static VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  WSQ_TARGET static VI bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  WSQ_TARGET static VI zero() { return _mm512_setzero_si512(); }
  WSQ_TARGET static VI dot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
  WSQ_TARGET static VI dot2(VI acc, VI u1, VI s1, VI u2, VI s2) { return dot(dot(acc, u1, s1), u2, s2); }
  WSQ_TARGET static VI dot_s(VI acc, VI w, VI s) {
    // |w| as unsigned bytes (-128 -> 128) and x negated where w < 0
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return dot(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
  }
  WSQ_TARGET static VI lo4(VI w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  WSQ_TARGET static VI hi4(VI w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  WSQ_TARGET static VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  WSQ_TARGET static VI bits(VI h, int shift, int mask) {
    const VI v = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8(char(mask)));
    return _mm512_slli_epi16(v, 4);
  }
  WSQ_TARGET static VI shl16(VI v, int n) { return _mm512_slli_epi16(v, n); }
  WSQ_TARGET static VI shr16(VI v, int n) { return _mm512_srli_epi16(v, n); }
  WSQ_TARGET static VI and8(VI v, int m) { return _mm512_and_si512(v, _mm512_set1_epi8(char(m))); }
  WSQ_TARGET static VI mxfp4(VI nibbles) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Plus12));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(t), nibbles);
  }
  WSQ_TARGET static VF e8m0(const uint8_t* p) {  // 2 ** (e - 128), as e8m0_half_bits
    const VI e = u8(p);
    const VI normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const VI tiny = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(1)), 21);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
  }
  WSQ_TARGET static VI u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static VI s8(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static VF f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  WSQ_TARGET static VI pairs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
  WSQ_TARGET static VI add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
  WSQ_TARGET static VI madd16(VI a, VI b) { return _mm512_madd_epi16(a, b); }
  WSQ_TARGET static __m128i bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  // 16 byte pairs (a[r], b[r]) side by side: 32 bytes, widened below
  WSQ_TARGET static __m256i zip(__m128i a, __m128i b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)), _mm_unpackhi_epi8(a, b), 1);
  }
  WSQ_TARGET static VI scale16u(const uint8_t* p) {
    const __m128i v = bytes16(p);
    return _mm512_cvtepu8_epi16(zip(v, v));
  }
  WSQ_TARGET static VI scale16s(const uint8_t* p) {
    const __m128i v = bytes16(p);
    return _mm512_cvtepi8_epi16(zip(v, v));
  }
  WSQ_TARGET static VI pair16u(const uint8_t* a, const uint8_t* b) {
    return _mm512_cvtepu8_epi16(zip(bytes16(a), bytes16(b)));
  }
  WSQ_TARGET static VI pair16s(const uint8_t* a, const uint8_t* b) {
    return _mm512_cvtepi8_epi16(zip(bytes16(a), bytes16(b)));
  }
  WSQ_TARGET static VI shl32(VI v, int n) { return _mm512_slli_epi32(v, n); }
  WSQ_TARGET static VI add(VI a, VI b) { return _mm512_add_epi32(a, b); }
  WSQ_TARGET static VI sub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
  WSQ_TARGET static VI mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  WSQ_TARGET static VI set1(int32_t v) { return _mm512_set1_epi32(v); }
  WSQ_TARGET static VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
  WSQ_TARGET static VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  WSQ_TARGET static VF fadd(VF a, VF b) { return _mm512_add_ps(a, b); }
  WSQ_TARGET static VF fsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
  WSQ_TARGET static VF fset1(float v) { return _mm512_set1_ps(v); }
  WSQ_TARGET static VF fzero() { return _mm512_setzero_ps(); }
  WSQ_TARGET static void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
  // activation quantization (quantize_rows in qgemm_simd.h)
  WSQ_TARGET static VF fload(const float* p) { return _mm512_loadu_ps(p); }
  WSQ_TARGET static VF fload(const uint16_t* p) {  // bf16 -> float, exact
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  WSQ_TARGET static VF fabs_(VF v) { return _mm512_abs_ps(v); }
  WSQ_TARGET static VF fmax_(VF a, VF b) { return _mm512_max_ps(a, b); }
  WSQ_TARGET static float hmax(VF v) { return _mm512_reduce_max_ps(v); }
  WSQ_TARGET static VI round_clamp(VF v) {  // nearest even (the default MXCSR mode), then +-127
    const VI q = _mm512_cvtps_epi32(v);
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  }
  WSQ_TARGET static void store_q8(int8_t* p, VI v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  WSQ_TARGET static int32_t hsum(VI v) { return _mm512_reduce_add_epi32(v); }
};

#include "qgemm_simd.h"

}  // namespace avx512

const GroupFn* kernels_avx512() { return avx512::kTable; }
QuantizeFn quantizer_avx512() { return avx512::quantize_rows; }

}  // namespace wsq
