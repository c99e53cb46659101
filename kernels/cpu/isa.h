// Which vector path this CPU can run (Isa in qgemm.h: 0 AVX-512 VNNI, 1 AVX2, 2 scalar), asked once per
// checked call; kernels/quant.py picks the best one and force_isa pins another for the tests.
#pragma once

#include <cstdint>

namespace wsq {

// Can this CPU (and this build) run the ISA path `isa`?
bool cpu_has(int64_t isa);

}  // namespace wsq
