// The torch entry points of attention.cpp (kernels/cpu_attention.py): paged decode attention read
// through the block tables in place, and the decode step's rotary + KV store + attention in one call.
#pragma once

#include <torch/extension.h>

namespace wsq {

// A layer's attention variant (kernels/paged_attention.py), each off by default: a sliding
// window of `window` positions (0: none), scores soft-capped as softcap * tanh(s / softcap)
// (0: none), sinks a float32 [H] logit per query head in the softmax's denominator.
struct AttnVariant {
  int64_t window = 0;
  double softcap = 0.0;
  c10::optional<torch::Tensor> sinks;
};

// q [n, H, D] (rows may be strided: the q part of the fused qkv), caches [blocks, bs, Hk, D] of
// q's dtype or a half type (float16; bfloat16 under float32 q), tables int32 [n, width], lens
// int32 [n] -> [n, H * D] in q's dtype. isa: the path quant.isa_index() chose; window, softcap
// and sinks: the AttnVariant.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                               torch::Tensor lens, double scale, int64_t isa, int64_t window = 0,
                               double softcap = 0.0, c10::optional<torch::Tensor> sinks = c10::nullopt);
// rope_store (rowops.h) on qkv [n, (H + 2 Hk) D], then decode_attention of its rotated q rows
// -> [n, H * D]: a decode-only step's attention. Everything is checked before the cache is written.
torch::Tensor rope_store_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, torch::Tensor tables,
                                torch::Tensor lens, double scale, int64_t isa, int64_t window = 0,
                                double softcap = 0.0, c10::optional<torch::Tensor> sinks = c10::nullopt);
// The same with the variant as one value (DecodeStack's layers).
torch::Tensor rope_store_decode_v(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                  const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& slots, int64_t num_heads, const torch::Tensor& tables,
                                  const torch::Tensor& lens, double scale, int64_t isa, const AttnVariant& var);

}  // namespace wsq
