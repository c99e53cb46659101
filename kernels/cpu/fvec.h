// The float vector kernels (fvec_avx512.cpp, fvec_avx2.cpp, a scalar version beside each caller):
// paged decode attention on the CPU (attention.cpp, kernels/cpu_attention.py), one query token
// per sequence against its context in the paged KV cache, read through the block table in place
// (no gather, no padding, no mask); and SiLU(gate) * up and RMSNorm over float32 or bf16 rows
// (rowops.cpp). No torch here, as in qgemm.h: the vector files compile without it.
//
// Element types: float; uint16_t holds bfloat16 bits; f16 holds IEEE half bits (a KV cache
// under a float32 model: read widened exactly, written rounded to nearest even).
#pragma once

#include <cstdint>

namespace wsq {

struct f16 {
  uint16_t bits;
};

// What a DecodeArgs pointer holds (q and out: kF32 or kBF16; the caches any of the three).
enum ElemType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct DecodeArgs {
  const void* q;          // [n, H, D] rows q_stride elements apart, heads D apart
  int64_t q_stride;
  const void* k;          // caches [blocks, bs, Hk, D]
  const void* v;
  const int32_t* tables;  // [n, width] block ids
  int64_t width;
  const int32_t* lens;    // [n] context length, this step's token included
  int H, Hk, D, bs;
  float scale;
  int q_type;             // ElemType of q and out
  int kv_type;            // ElemType of the caches
  void* out;              // [n, H * D]
  // The layer's attention variant (kernels/paged_attention.py), each off by default: a row
  // sees its last `window` positions (0: all; the blocks before are never read), scores are
  // softcap * tanh(s / softcap) (0: as they are), and sinks[h] (float32 [H]; null: none) is one
  // more logit in each query head's softmax denominator.
  int window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;
};

// The first position row s sees: its last `window` positions of len.
inline int first_seen(const DecodeArgs& a, int len) { return a.window > 0 && len > a.window ? len - a.window : 0; }

// Work items are (sequence, kv head) pairs, item = seq * Hk + kv head; scratch holds
// decode_scratch_floats(a) floats for the caller's thread, 8-byte aligned: each position's
// row offset (int64) for the table's width, then up to G query rows and score rows.
using DecodeFn = void (*)(const DecodeArgs& a, int64_t item0, int64_t item1, float* scratch);
inline int64_t decode_scratch_floats(const DecodeArgs& a, int64_t max_len) {
  return 2 * a.width * a.bs + int64_t(a.H / a.Hk) * (a.D + max_len + 16);
}

DecodeFn decode_attention_avx512();  // D a multiple of 16
DecodeFn decode_attention_avx2();    // D a multiple of 8
DecodeFn decode_attention_scalar();

// Rows [m0, m1) of x [M, 2 d] (gate | up) -> out [M, d], float32 (bf16 false) or bf16 bits:
// silu(gate) rounded to the type, times up, rounded (the reference's roundings; the vector exp
// may differ from torch's in the last bit).
using SiluFn = void (*)(const void* x, void* out, int64_t m0, int64_t m1, int64_t d);
SiluFn silu_mul_avx512(bool bf16);
SiluFn silu_mul_avx2(bool bf16);
// Rows [m0, m1): h = x + res (res null: no add, h unwritten), out = rms_norm(h) * w, with
// the reference's roundings (rowops.h: add_rms_norm); the sum of squares in another order.
using NormFn = void (*)(const void* x, const void* res, const void* w, void* out, void* h, int64_t m0, int64_t m1,
                        int64_t K, float eps);
NormFn norm_rows_avx512(bool bf16);
NormFn norm_rows_avx2(bool bf16);

// float -> bfloat16 bits, nearest even (as torch rounds); NaN stays NaN
inline uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// IEEE half bits -> float, exact (normals, subnormals, zeros, infinities, NaN)
inline float from_f16(f16 h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 0x1Fu, m = h.bits & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {  // subnormal: m * 2^-24, exact in float
    const float f = float(m) * 0x1p-24f;
    __builtin_memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Any element type as float, exactly; a float as q's and out's types (float or bf16 bits).
inline float widen(float x) { return x; }
inline float widen(uint16_t b) { return from_bf16(b); }
inline float widen(f16 h) { return from_f16(h); }
template <class T>
inline T narrow(float x) {
  if constexpr (sizeof(T) == 2)
    return to_bf16(x);
  else
    return x;
}

}  // namespace wsq
