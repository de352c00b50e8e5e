// Launch files for tests that start `aqswarm stage` themselves: the job
// file's JSON under "job" and the launch's other fields (proto/stage.proto,
// protobuf's JSON names) beside it.
//
//   const std::string launch = WriteStageLaunchFile(dir / "s1.json", job_path,
//       {{"stage", 1}, {"storeDir", store}, {"linkTimeout", "30s"}});
//   Subprocess::Spawn({kBinary, "stage", "--launch=" + launch}, ...);
#ifndef AQSWARM_TESTS_TESTING_STAGE_LAUNCH_FILE_H_
#define AQSWARM_TESTS_TESTING_STAGE_LAUNCH_FILE_H_

#include <string>

#include "nlohmann/json.hpp"

namespace aqswarm::testing {

// Writes the launch to `path` and returns `path`; a job file that is not
// JSON goes in as a string (the stage then refuses it). Fails the test
// (ADD_FAILURE) when a file cannot be read or written.
std::string WriteStageLaunchFile(const std::string& path, const std::string& job_path, nlohmann::json fields);

}  // namespace aqswarm::testing

#endif  // AQSWARM_TESTS_TESTING_STAGE_LAUNCH_FILE_H_
