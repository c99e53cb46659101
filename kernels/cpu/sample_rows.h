// The sampler's torch side (sample.cpp: sample_rows, the rows' logic and checks): its binding.
#pragma once

#include <torch/extension.h>

namespace wsq {
void register_sampling(pybind11::module& m);
}  // namespace wsq
