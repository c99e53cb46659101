// The quantized matmul's shared declarations: formats, the packed layout, quantized activations.
//
// Layout and arithmetic are those of kernels/quant_formats.py and kernels/quant_ref.py (read
// those first): weights in groups of kRows output rows, for every GGUF block the fields of
// the 16 rows side by side; quant bytes as 64-byte "units" holding 4 bytes of each row, so
// that one int32 lane is one output row. No torch here: the kernel files compile without
// torch's headers, only qgemm.cpp includes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace wsq {

constexpr int kRows = 16;          // output rows per group
constexpr int kUnit = kRows * 4;   // bytes of a unit: 4 quant bytes of each row

// Numbering shared with kernels/quant.py (QTYPES order).
enum QType : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, kNumQTypes = 6 };
enum Isa : int { kAvx512Vnni = 0, kAvx2 = 1, kScalar = 2 };

constexpr int block_values(int qt) { return qt >= Q4_K ? 256 : 32; }

// Byte offsets of the fields inside one (group, block), FIELDS' order in quant_formats.py:
// fp16 scales take 2 * kRows bytes, byte-per-row scales kRows per sub-block, quants units.
struct Off {
  int d, m, sc, mn, qh, qs, bytes;  // m: Q4_1's min or the K-quants' dmin; qs: Q6_K's ql
};
constexpr Off offsets(int qt) {
  return qt == Q4_0   ? Off{0, -1, -1, -1, -1, 2 * kRows, 2 * kRows + 4 * kUnit}
         : qt == Q4_1 ? Off{0, 2 * kRows, -1, -1, -1, 4 * kRows, 4 * kRows + 4 * kUnit}
         : qt == Q8_0 ? Off{0, -1, -1, -1, -1, 2 * kRows, 2 * kRows + 8 * kUnit}
         : qt == Q4_K ? Off{0, 2 * kRows, 4 * kRows, 12 * kRows, -1, 20 * kRows, 20 * kRows + 32 * kUnit}
         : qt == Q5_K ? Off{0, 2 * kRows, 4 * kRows, 12 * kRows, 20 * kRows, 20 * kRows + 8 * kUnit,
                            20 * kRows + 40 * kUnit}
                      : Off{0, -1, 2 * kRows, -1, 18 * kRows + 32 * kUnit, 18 * kRows, 18 * kRows + 48 * kUnit};
}
constexpr int packed_bytes(int qt) { return offsets(qt).bytes; }

// The quantized rows of x, made once per call (qgemm.cpp): blocks of 32 or 256 values.
struct Act {
  int K = 0;           // values per row
  int nb = 0;          // blocks per row (K / block_values)
  const float* d;      // [M][nb] block scales
  const int32_t* s16;  // [M][K / 16] sums of every 16 quants
  const int8_t* q;     // [M][K] quants
  const int32_t* s16p = nullptr;  // Q6_K: [M][K / 32] s16's pairs as the int16 halves (|sum| <= 16 * 127)
  const float* dx(int m) const { return d + (size_t)m * nb; }
  const int32_t* sums(int m) const { return s16 + (size_t)m * (K / 16); }
  const int8_t* qrow(int m) const { return q + (size_t)m * K; }
  const int32_t* pairs(int m) const { return s16p + (size_t)m * (K / 32); }
};

// x's rows quantized once for the matmuls (qgemm.cpp: quantize_act), owning what an Act views.
struct ActRows {
  int64_t M = 0;
  int K = 0, bv = 32;
  std::unique_ptr<float[]> d;
  std::unique_ptr<int32_t[]> s16, s16p;
  std::unique_ptr<int8_t[]> q;
  // room for M rows of K values in blocks of bv (pairs: Q6_K's s16 pairs too)
  void alloc(int64_t rows, int k, int block, bool pairs);
  // the kernels' view of rows `row` .. M - 1 (a group kernel's m0 counts from `row`)
  Act view(int64_t row = 0) const;
};

// One group of kRows output rows for x rows m0 .. m0 + mt - 1 (mt <= kMaxTile):
// out[i * kRows + r] = x row m0 + i times the group's row r, summed over the blocks.
constexpr int kMaxTile = 4;

// Bytes ahead of its loads that the first x tile of a 32-value format (Q4_0, Q4_1, Q8_0)
// prefetches the weights: one core's stream needs requests in flight beyond what the hardware
// prefetcher issues (Q6_K measured 1.5x with it). A variable so bench/quantized_linear.py can
// sweep it (set_prefetch_ahead); 0 turns it off.
constexpr int kPrefetchAhead = 2048;
extern int prefetch_ahead;
// The same for the K-quants (set_prefetch_k), each unit's line prefetched beside its load (a
// block's 37-53 lines in one burst at its start measured no faster than none): Q4_K and Q5_K
// at m0 == 0, 2 KB ahead; Q6_K 4 blocks ahead (kChunk), at M > 1 each pass of row vectors
// prefetching its share of the block's lines, at batch 1 the block's lines in address order.
// One thread, cold weights, AVX2: Q4_K 1.2-1.3x, Q5_K ~1.5x, Q6_K ~1.15x (docs/benchmarks.md).
constexpr int kPrefetchK45 = 2048, kPrefetchQ6K = 4 * (18 + 48 * 4) * 16;
extern int prefetch_k45, prefetch_q6k;
using GroupFn = void (*)(const uint8_t* group, const Act& a, int m0, int mt, float* out);

// Tables indexed by QType.
const GroupFn* kernels_scalar();
const GroupFn* kernels_avx2();
const GroupFn* kernels_avx512();

// x rows m0 .. m1 - 1 (float32, or bfloat16 bits when bf16) -> Act's blocks d, s16, q.
using QuantizeFn = void (*)(const void* x, bool bf16, int64_t m0, int64_t m1, int K, int bv, float* d,
                            int32_t* s16, int8_t* q);
QuantizeFn quantizer_avx2();
QuantizeFn quantizer_avx512();

// The quantizer and the group kernel of an ISA path (Isa) and a format.
QuantizeFn quantizer(int64_t isa);  // null: the scalar loop of qgemm.cpp
GroupFn group_kernel(int64_t isa, int qtype);
// Rows m0 .. m1 - 1 of x [M, K] (float32, or bfloat16 bits when bf16) into `a`'s blocks on the ISA's
// quantizer, as quant_ref.quantize_activations: d = amax * (1/127), q = round-to-even(x * (1 / d)).
void quantize_act(const void* x, bool bf16, int64_t m0, int64_t m1, int64_t isa, ActRows& a);

// Row r of a group -> nb * block_values floats, bit-equal to gguf.quants.dequantize.
void dequant_row(int qt, const uint8_t* group, int nb, int r, float* out);

}  // namespace wsq
