// A fresh temporary directory for a benchmark's files.
#ifndef AQSWARM_BENCH_TEMP_DIR_H_
#define AQSWARM_BENCH_TEMP_DIR_H_

#include <stdlib.h>

#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

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

}  // namespace aqswarm::bench

#endif  // AQSWARM_BENCH_TEMP_DIR_H_
