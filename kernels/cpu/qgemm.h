// The quantized matmul's shared declarations: formats, the packed layout, quantized activations.
//
// Layout and arithmetic are those of kernels/quant_formats.py and kernels/quant_ref.py (read
// those first): weights in groups of kRows output rows, for every GGUF block the fields of
// the 8 rows side by side; quant bytes as 32-byte "units" holding 4 bytes of each row, so
// that one int32 lane of a vector is one output row. This header has no torch in it: the
// kernel files compile without torch's headers, only qgemm.cpp includes them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsq {

constexpr int kRows = 8;  // output rows per group

// Numbering shared with kernels/quant.py (QTYPES order).
enum QType : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, kNumQTypes = 6 };
enum Isa : int { kAvx512Vnni = 0, kAvx2 = 1, kScalar = 2 };

// Values per GGUF block and bytes of one (group, block) of the packed layout.
constexpr int block_values(int qt) { return qt >= Q4_K ? 256 : 32; }
constexpr int packed_bytes(int qt) {
  return qt == Q4_0   ? 144
         : qt == Q4_1 ? 160
         : qt == Q8_0 ? 272
         : qt == Q4_K ? 1184
         : qt == Q5_K ? 1440
                      : 1680;
}

// The quantized rows of x, made once per call (qgemm.cpp): blocks of 32 or 256 values.
struct Act {
  int K = 0;               // values per row
  int nb = 0;              // blocks per row (K / block_values)
  const float* d;          // [M][nb] block scales
  const int32_t* s16;      // [M][K / 16] sums of every 16 quants
  const int8_t* q;         // [M][K] quants (the scalar path)
  const int8_t* qx;        // [M][K / 4][32]: each 4 quants repeated 8 times (the vector paths)
  const float* dx(int m) const { return d + (size_t)m * nb; }
  const int32_t* sums(int m) const { return s16 + (size_t)m * (K / 16); }
  const int8_t* qrow(int m) const { return q + (size_t)m * K; }
  const int8_t* xrow(int m) const { return qx + (size_t)m * K * 8; }
};

// One group of 8 output rows for x rows m0 .. m0 + mt - 1 (mt <= kMaxTile):
// out[i * 8 + r] = the dot product of x row m0 + i with the group's row r, summed over blocks.
constexpr int kMaxTile = 4;
using GroupFn = void (*)(const uint8_t* group, const Act& a, int m0, int mt, float* out);

// Tables indexed by QType; a null table: this ISA was not compiled.
const GroupFn* kernels_scalar();
const GroupFn* kernels_avx2();
const GroupFn* kernels_avx512();

}  // namespace wsq
