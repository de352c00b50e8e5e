// The job's names across its forms and builds (proto/job.proto):
//
//   const auto* v = FindJobEnumValue(v1::JobSpec::Schedule::Value_descriptor(), "1f1b");  // one_f_one_b
//   AQSWARM_RETURN_IF_ERROR(UpgradeStoredJob(&job));  // a job an older build stored in binary
//
// The JSON reader and writer of jobs (pipeline/job_spec.h) and the
// coordinator's state dir (coordinator/coordinator_state.h) use these.
#ifndef AQSWARM_PROTO_JOB_FORMAT_H_
#define AQSWARM_PROTO_JOB_FORMAT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "proto/job.pb.h"

namespace aqswarm::job_format {

// The value of `e` that JSON names `name`: its proto name or its json_alias
// option; nullptr when none does.
const google::protobuf::EnumValueDescriptor* FindJobEnumValue(const google::protobuf::EnumDescriptor* e,
                                                              absl::string_view name);

// What JSON calls `v`: its json_alias, else its name.
const std::string& JobEnumJsonName(const google::protobuf::EnumValueDescriptor* v);

// The names a job's JSON may give `e`, for error messages: "a, b or c"
// (value 0 left out when it is an UNSPECIFIED).
std::string JobEnumChoices(const google::protobuf::EnumDescriptor* e);

// Builds before 2026-12 stored these choices as strings under numbers that
// are now reserved (model.family, optimizer.loss_scale, compression's
// m_precision, store, first_visit, rotation, tile_along, tile_grid,
// bw_codec, schedule, precision). Parsing such bytes keeps them as unknown
// fields; this moves each into its enum field ("" = UNSPECIFIED) and drops
// it. DataLoss naming the field when a stored string is no value of it.
// Jobs with no such fields are left as they are.
absl::Status UpgradeStoredJob(v1::JobSpec* job);

}  // namespace aqswarm::job_format

#endif  // AQSWARM_PROTO_JOB_FORMAT_H_
