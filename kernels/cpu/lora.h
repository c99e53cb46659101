// The grouped low-rank pass of LoRA adapters (kernels/lora.py): one row of x through one piece of
// an adapter, y[m, offset : offset + n] += (x[m] . A^T) . BT. The shrink's r dot products run over
// K in vector lanes (4 rows of A at a time, each then summed across its lanes), the expand over n
// (each t[j] times BT's row j, added in order of j); a row is computed the same way whatever other
// rows its batch holds, so its bits do not depend on the batch. No torch here (as fvec.h): the
// vector files compile without it. lora_weights.h holds the torch side.
#pragma once

#include <cstdint>

namespace wsq {

constexpr int kMaxLoraRank = 256;  // kernels/lora.py: MAX_NATIVE_RANK

struct LoraPiece {
  const float* a;   // [r, K] lora_A
  const float* bt;  // [r, n] lora_B^T times the scaling
  int r, K, n;
  int64_t offset;  // the piece's first column in y's rows
};

// Row m of x [M, K] (float32, or bf16 bits when bf16) through piece p into y [M, N] (x's type).
using LoraRowFn = void (*)(const LoraPiece& p, const void* x, void* y, int64_t N, int64_t m);
LoraRowFn lora_row_avx512(bool bf16);
LoraRowFn lora_row_avx2(bool bf16);
LoraRowFn lora_row_scalar(bool bf16);

}  // namespace wsq
