#include "common/malloc_tuning.h"

#include <malloc.h>

#include <climits>
#include <cstdlib>

namespace aqswarm {

bool KeepFreedMemoryForReuse(size_t mmap_threshold, size_t trim_threshold) {
  auto clamp = [](size_t v) { return static_cast<int>(v > INT_MAX ? INT_MAX : v); };
  bool ok = true;
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) {
    ok = mallopt(M_MMAP_THRESHOLD, clamp(mmap_threshold)) == 1 && ok;
  }
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) {
    ok = mallopt(M_TRIM_THRESHOLD, clamp(trim_threshold)) == 1 && ok;
  }
  return ok;
}

}  // namespace aqswarm
