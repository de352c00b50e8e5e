#include "tests/testing/json_lines.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/subprocess.h"
#include "gtest/gtest.h"

namespace aqswarm::testing {

JsonLinesRun RunForJsonLines(const std::vector<std::string>& argv, const std::string& err_path,
                             absl::Duration line_timeout) {
  std::error_code ec;
  std::filesystem::remove(err_path, ec);
  JsonLinesRun r;
  auto child = Subprocess::Spawn(argv, {.capture_stdout = true, .stderr_path = err_path});
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return r;
  for (std::string line; (*child)->ReadLine(&line, line_timeout).ok();) {
    r.rows.push_back(nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false));
    EXPECT_FALSE(r.rows.back().is_discarded()) << "not JSON: " << line;
  }
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(30));
  r.code = code.ok() ? *code : -1;
  std::stringstream ss;
  ss << std::ifstream(err_path).rdbuf();
  r.err = ss.str();
  return r;
}

}  // namespace aqswarm::testing
