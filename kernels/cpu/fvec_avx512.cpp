// The AVX-512 float kernels (attention_simd.h, rows_simd.h, lora_simd.h, sample_simd.h): 16 float lanes.
#include <immintrin.h>

#include <cmath>

#include "fvec.h"
#include "lora.h"
#include "sample.h"
#include "moe.h"

#define WSQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace wsq {
namespace fvec512 {

struct FV {
  using VF = __m512;
  static constexpr int L = 16;
  static constexpr int kValueChunk = 4;  // 4 heads x 4 accumulators + 4 value vectors fit
  WSQ_TARGET static VF load(const float* p) { return _mm512_loadu_ps(p); }
  WSQ_TARGET static VF load(const uint16_t* p) {  // bf16 -> float, exact
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  WSQ_TARGET static VF load(const f16* p) {  // half -> float, exact
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  WSQ_TARGET static void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
  WSQ_TARGET static VF set1(float v) { return _mm512_set1_ps(v); }
  WSQ_TARGET static VF zero() { return _mm512_setzero_ps(); }
  WSQ_TARGET static VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
  WSQ_TARGET static VF sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
  WSQ_TARGET static VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  WSQ_TARGET static VF div(VF a, VF b) { return _mm512_div_ps(a, b); }
  // to the nearest bfloat16 (even on ties), still as float; then its 16 bits stored
  WSQ_TARGET static VF round_bf16(VF v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  WSQ_TARGET static void store_bf16(uint16_t* p, VF rounded) {
    const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
  }
  WSQ_TARGET static VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  WSQ_TARGET static float hsum(VF v) { return _mm512_reduce_add_ps(v); }
  WSQ_TARGET static VF max(VF a, VF b) { return _mm512_max_ps(a, b); }
  WSQ_TARGET static float hmax(VF v) { return _mm512_reduce_max_ps(v); }
  // one bit a lane: a >= b, a == b (false where either is NaN)
  WSQ_TARGET static uint32_t ge_bits(VF a, VF b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  WSQ_TARGET static uint32_t eq_bits(VF a, VF b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  WSQ_TARGET static VF select_ge(VF a, VF b, VF x, VF y) {  // a >= b ? x : y, a lane at a time
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), y, x);
  }
  // e^x within a few ulp for x in [-87, 88]; clamped there (e^-87 ~ 1e-38 stands in for 0)
  WSQ_TARGET static VF exp(VF x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
    const VF nf = _mm512_cvtepi32_ps(n);
    VF r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(-2.12194440e-4f), r);
    VF y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  }
};

#include "attention_simd.h"
#include "rows_simd.h"
#include "lora_simd.h"
#include "sample_simd.h"
#include "moe_simd.h"

}  // namespace fvec512

DecodeFn decode_attention_avx512() { return fvec512::decode_items; }
RouterFn router_logits_avx512() { return fvec512::router_logits; }
SiluFn silu_mul_avx512(bool bf16) { return fvec512::silu_rows(bf16); }
NormFn norm_rows_avx512(bool bf16) { return fvec512::norm_rows(bf16); }
LoraTileFn lora_tile_avx512(bool x_bf16, bool w_bf16, int rows) { return fvec512::lora_tile(x_bf16, w_bf16, rows); }
SampleFns sample_fns_avx512() { return fvec512::sample_fns(); }

}  // namespace wsq
