#include "compression/max_abs.h"

#include <cstring>

namespace aqswarm::compression::internal {

__attribute__((target_clones("avx2", "default")))
uint32_t MaxAbsBits(const float* x, size_t n) {
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    u &= 0x7fffffffu;
    m = u > m ? u : m;
  }
  return m;
}

}  // namespace aqswarm::compression::internal
