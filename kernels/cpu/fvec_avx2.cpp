// The AVX2 float kernels (attention_simd.h, rows_simd.h, lora_simd.h, sample_simd.h): 8 float lanes.
#include <immintrin.h>

#include <cmath>

#include "fvec.h"
#include "lora.h"
#include "sample.h"
#include "moe.h"

#define WSQ_TARGET __attribute__((target("avx2,fma,f16c")))

namespace wsq {
namespace fvec256 {

struct FV {
  using VF = __m256;
  static constexpr int L = 8;
  static constexpr int kValueChunk = 2;  // 4 heads x 2 accumulators + 2 value vectors fit
  WSQ_TARGET static VF load(const float* p) { return _mm256_loadu_ps(p); }
  WSQ_TARGET static VF load(const uint16_t* p) {  // bf16 -> float, exact
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  WSQ_TARGET static VF load(const f16* p) {  // half -> float, exact
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  WSQ_TARGET static void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
  WSQ_TARGET static VF set1(float v) { return _mm256_set1_ps(v); }
  WSQ_TARGET static VF zero() { return _mm256_setzero_ps(); }
  WSQ_TARGET static VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
  WSQ_TARGET static VF sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
  WSQ_TARGET static VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  WSQ_TARGET static VF div(VF a, VF b) { return _mm256_div_ps(a, b); }
  WSQ_TARGET static VF round_bf16(VF v) {  // as the AVX-512 version
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  WSQ_TARGET static void store_bf16(uint16_t* p, VF rounded) {
    const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);  // 8 values < 2**16
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  WSQ_TARGET static VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  WSQ_TARGET static float hsum(VF v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  WSQ_TARGET static VF max(VF a, VF b) { return _mm256_max_ps(a, b); }
  WSQ_TARGET static float hmax(VF v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  // one bit a lane: a >= b, a == b (false where either is NaN)
  WSQ_TARGET static uint32_t ge_bits(VF a, VF b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ))); }
  WSQ_TARGET static uint32_t eq_bits(VF a, VF b) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ))); }
  WSQ_TARGET static VF select_ge(VF a, VF b, VF x, VF y) {  // a >= b ? x : y, a lane at a time
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GE_OQ));
  }
  // e^x, as the AVX-512 version
  WSQ_TARGET static VF exp(VF x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
    const VF nf = _mm256_cvtepi32_ps(n);
    VF r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(-2.12194440e-4f), r);
    VF y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
};

#include "attention_simd.h"
#include "rows_simd.h"
#include "lora_simd.h"
#include "sample_simd.h"
#include "moe_simd.h"

}  // namespace fvec256

DecodeFn decode_attention_avx2() { return fvec256::decode_items; }
RouterFn router_logits_avx2() { return fvec256::router_logits; }
SiluFn silu_mul_avx2(bool bf16) { return fvec256::silu_rows(bf16); }
NormFn norm_rows_avx2(bool bf16) { return fvec256::norm_rows(bf16); }
LoraTileFn lora_tile_avx2(bool x_bf16, bool w_bf16, int rows) { return fvec256::lora_tile(x_bf16, w_bf16, rows); }
SampleFns sample_fns_avx2() { return fvec256::sample_fns(); }

}  // namespace wsq
