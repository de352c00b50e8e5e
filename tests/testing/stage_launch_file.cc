#include "tests/testing/stage_launch_file.h"

#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace aqswarm::testing {

std::string WriteStageLaunchFile(const std::string& path, const std::string& job_path, nlohmann::json fields) {
  std::ifstream in(job_path);
  if (!in) ADD_FAILURE() << "cannot read " << job_path;
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json job = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  fields["job"] = job.is_discarded() ? nlohmann::json(ss.str()) : job;
  std::ofstream out(path);
  out << fields.dump() << "\n";
  if (!out) ADD_FAILURE() << "cannot write " << path;
  return path;
}

}  // namespace aqswarm::testing
