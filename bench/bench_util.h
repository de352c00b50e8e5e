// Small pieces the benchmarks and their CLI share.
#ifndef AQSWARM_BENCH_BENCH_UTIL_H_
#define AQSWARM_BENCH_BENCH_UTIL_H_

#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace aqswarm::bench {

// Creates `<dir>/<prefix>XXXXXX` (dir: $TMPDIR or /tmp when empty) and returns
// its path; FailedPrecondition naming `dir` when it cannot.
inline absl::StatusOr<std::string> MakeTempDir(std::string dir, const std::string& prefix) {
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = (tmp != nullptr && *tmp != '\0') ? tmp : "/tmp";
  }
  std::string path = dir + "/" + prefix + "XXXXXX";
  if (::mkdtemp(path.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create a temporary directory under '", dir, "'"));
  }
  return path;
}

// Parses a row shape "ROWSxCOLS" (both > 0); false if `spec` is not one.
inline bool ParseRowShape(absl::string_view spec, int64_t* rows, int64_t* cols) {
  std::vector<absl::string_view> dims = absl::StrSplit(spec, 'x');
  return dims.size() == 2 && absl::SimpleAtoi(dims[0], rows) && absl::SimpleAtoi(dims[1], cols) && *rows > 0 &&
         *cols > 0;
}

// The q-quantile (q in [0, 1]) of `v` by nearest rank; 0 for an empty `v`.
inline double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

}  // namespace aqswarm::bench

#endif  // AQSWARM_BENCH_BENCH_UTIL_H_
