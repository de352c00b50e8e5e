#include "common/blas_kernels.h"

#include <dlfcn.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "common/logging.h"

namespace aqswarm {

std::string OpenBlasCore() {
  using CoreName = char* (*)();
  auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = fn != nullptr ? fn() : nullptr;
  return name != nullptr ? name : "";
}

std::string PickOpenBlasCoreForChildren() {
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  if (set != nullptr && *set) return set;
  const std::string core = OpenBlasCore();
  if (core.empty()) return "";
  static const char* kPreAvx2[] = {"Prescott", "Core2",  "Penryn", "Dunnington", "Nehalem", "Atom",
                                   "Sandybridge", "Katmai", "Coppermine", "Northwood", "Banias", "Unknown"};
  bool old = false;
  for (const char* k : kPreAvx2) old = old || absl::EqualsIgnoreCase(core, k);
  __builtin_cpu_init();
  if (!old || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return core;
  const char* pick = __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell";
  setenv("OPENBLAS_CORETYPE", pick, 1);  // inherited by every process started from now on
  AQSWARM_LOG(INFO) << "OpenBLAS chose its " << core << " kernels on a CPU with AVX2 and FMA; stages run with "
                    << "OPENBLAS_CORETYPE=" << pick;
  return pick;
}

}  // namespace aqswarm
