// The grouped low-rank pass of LoRA adapters (kernels/lora.py): rows of x through one piece of an
// adapter, y[m, offset : offset + n] += (x[m] . A^T) . BT. The shrink's r dot products run over K in
// vector lanes (4 rows of A at a time, each then summed across its lanes), the expand over n (each
// t[j] times BT's row j, added in order of j); a row is computed the same way whatever other rows
// its batch (or its tile) holds, so its bits do not depend on the batch. No torch here (as fvec.h):
// the vector files compile without it. lora_weights.h holds the torch side.
#pragma once

#include <cstdint>

namespace wsq {

constexpr int kMaxLoraRank = 256;  // kernels/lora.py: MAX_NATIVE_RANK

struct LoraPiece {
  const void* a;   // [r, K] lora_A: float32, or bfloat16 bits when `bf16`
  const void* bt;  // [r, n] lora_B^T times the scaling, the same type
  bool bf16;
  int r, K, n;
  int64_t offset;  // the piece's first column in y's rows
};

// Up to kLoraTile rows of x [M, K] (float32, or bf16 bits when x_bf16), their indices in `rows`,
// through piece p into y [M, N] (x's type): each row's sums in the same order whatever the tile,
// and the tile reads each vector of A and B once for all its rows.
constexpr int kLoraTile = 4;
using LoraTileFn = void (*)(const LoraPiece& p, const void* x, void* y, int64_t N, const int64_t* rows);
// the function for `rows` rows (1 .. kLoraTile) of activations of x_bf16 and weights of w_bf16
LoraTileFn lora_tile_avx512(bool x_bf16, bool w_bf16, int rows);
LoraTileFn lora_tile_avx2(bool x_bf16, bool w_bf16, int rows);
LoraTileFn lora_tile_scalar(bool x_bf16, bool w_bf16, int rows);

}  // namespace wsq
