// The torch entry points of attention.cpp (kernels/cpu_attention.py): paged decode attention read
// through the block tables in place, and the decode step's rotary + KV store + attention in one call.
#pragma once

#include <torch/extension.h>

namespace wsq {

// q [n, H, D] (rows may be strided: the q part of the fused qkv), caches [blocks, bs, Hk, D] of
// q's dtype or a half type (float16; bfloat16 under float32 q), tables int32 [n, width], lens
// int32 [n] -> [n, H * D] in q's dtype. isa: the path quant.isa_index() chose.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                               torch::Tensor lens, double scale, int64_t isa);
// rope_store (rowops.h) on qkv [n, (H + 2 Hk) D], then decode_attention of its rotated q rows
// -> [n, H * D]: a decode-only step's attention. Everything is checked before the cache is written.
torch::Tensor rope_store_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, torch::Tensor tables,
                                torch::Tensor lens, double scale, int64_t isa);

}  // namespace wsq
