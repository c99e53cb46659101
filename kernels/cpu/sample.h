// The sampler's passes over one row of logits (kernels/sampling.py: sample_rows; sample.cpp holds the
// row's logic and the torch side, sample_simd.h the passes for each vector ISA). No torch here (as
// fvec.h): the vector files compile without it.
//
// A row is sampled from p = softmax(l / T) restricted to its kept set, as wsllm/engine/sampler.py
// defines it, without sorting the vocabulary: e = exp(l / T - max) in one pass (with its sum),
// then only the tokens whose e lies in a band below the best ones are gathered and sorted, band
// after band, until the top-k / top-p / min-p cut is inside what was sorted.
#pragma once

#include <cstdint>

namespace wsq {

// e below this many e-folds under the row's best is 0: float32's exp is a denormal there
constexpr float kSampleMinExp = -87.0f;

// The positive e of a row are >= e^kSampleMinExp > FLT_MIN (1.2e-38): "e >= sample_floor(floor)" is
// "e >= floor and e > 0" in one comparison.
inline float sample_floor(float floor) { return floor > 1.17549435e-38f ? floor : 1.17549435e-38f; }

struct SampleFns {
  // max over the row; *nan set when the row holds a NaN
  float (*row_max)(const float* l, int64_t V, bool* nan);
  // the first index whose value equals v (V when none)
  int64_t (*first_eq)(const float* l, int64_t V, float v);
  // e[i] = exp(l[i] / T - ms) (0 below kSampleMinExp); returns the sum of every e; chunk[c] the sum
  // of chunk c's e that are >= floor (chunks of `chunk_len` values, the last one shorter)
  float (*exp_pass)(const float* l, int64_t V, float T, float ms, float floor, float* e, float* chunk,
                    int64_t chunk_len);
  // the indices i with lo <= e[i] < hi and e[i] > 0, in order, into idx; returns how many
  int64_t (*gather)(const float* e, int64_t V, float lo, float hi, int32_t* idx);
  // max over the i with e[i] >= floor and e[i] > 0 of e[i] / E[i] (-1 when there is none)
  float (*race_max)(const float* e, const float* E, int64_t V, float floor);
  // the first such i whose e[i] / E[i] equals v
  int64_t (*race_first)(const float* e, const float* E, int64_t V, float floor, float v);
};

SampleFns sample_fns_avx512();
SampleFns sample_fns_avx2();
SampleFns sample_fns_scalar();

}  // namespace wsq
