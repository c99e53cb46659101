// The run-time ISA check of isa.h: the CPU's flags (__builtin_cpu_supports) and whether the build
// has the path's kernels (a compiler without the target attribute leaves its table null).
#include "isa.h"

#include "qgemm.h"

namespace wsq {

bool cpu_has(int64_t isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kAvx512Vnni:
      return kernels_avx512() != nullptr && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx2:
      return kernels_avx2() != nullptr && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case kScalar:
      return true;
    default:
      return false;
  }
}

}  // namespace wsq
