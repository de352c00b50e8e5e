// Loading and validating a training job (`aqswarm.v1.JobSpec`, proto/job.proto).
//
//   AQSWARM_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec("job.json"));
//
// Parsing uses protobuf's JSON parser (unknown fields are errors); defaults are
// filled in for zero/empty fields, then every field is checked once. Errors
// name the offending field and value.
#ifndef AQSWARM_PIPELINE_JOB_SPEC_H_
#define AQSWARM_PIPELINE_JOB_SPEC_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace aqswarm::pipeline {

// Parses JSON text, applies defaults, validates.
absl::StatusOr<v1::JobSpec> ParseJobSpec(std::string_view json);
// Reads a JSON file, then ParseJobSpec.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// Fills zero/empty fields with documented defaults (see proto/job.proto).
void ApplyJobDefaults(v1::JobSpec* job);
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// Learning rate at `step` (0-based): linear warm-up, then linear decay to min_lr.
double LearningRateAt(const v1::OptimizerSpec& opt, int64_t step);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_JOB_SPEC_H_
