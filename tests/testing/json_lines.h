// Runs a command that prints one JSON object per line (`aqswarm bench ...`)
// and collects them with its exit code and stderr.
#ifndef AQSWARM_TESTS_TESTING_JSON_LINES_H_
#define AQSWARM_TESTS_TESTING_JSON_LINES_H_

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace aqswarm::testing {

struct JsonLinesRun {
  int code = -1;                     // exit code (128 + signal); -1: did not start or exit
  std::vector<nlohmann::json> rows;  // stdout, one JSON object per line
  std::string err;                   // stderr
};

// Runs `argv` with stderr in `err_path`; each line must come within
// `line_timeout` (a line that is no JSON fails the calling test).
JsonLinesRun RunForJsonLines(const std::vector<std::string>& argv, const std::string& err_path,
                             absl::Duration line_timeout);

}  // namespace aqswarm::testing

#endif  // AQSWARM_TESTS_TESTING_JSON_LINES_H_
