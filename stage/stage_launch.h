// The stage process's one input, v1::StageLaunch (proto/stage.proto): read,
// defaulted and validated here, once, by `aqswarm stage --launch FILE`
// (stage/stage_main.h); what the launchers (peer/assignment.h
// StageLaunchFor, `aqswarm pipeline`) write.
//
//   AQSWARM_ASSIGN_OR_RETURN(v1::StageLaunch launch, ReadStageLaunch("w/launch.json"));
//   launch.next().stage_link_address();   // every default filled in
//   LinkGeneration(launch.next());        // 1 where the launcher left 0
#ifndef AQSWARM_STAGE_STAGE_LAUNCH_H_
#define AQSWARM_STAGE_STAGE_LAUNCH_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/stage.pb.h"

namespace aqswarm::stage {

// Defaults of the launch's own fields (the job's are pipeline/job_spec.h's).
inline constexpr char kDefaultListen[] = "127.0.0.1:0";
inline constexpr uint32_t kDefaultKeepCheckpoints = 4;
inline constexpr int64_t kDefaultLinkTimeoutSeconds = 120;
// The message store's budget when the job leaves compression.storeBytes unset.
inline constexpr uint64_t kDefaultStoreBytes = 64ull << 30;

// Parses a launch: the "job" object by pipeline::ParseJobSpec (the job's
// JSON rules, defaults, validation), the rest by protobuf's JSON mapping
// (an unknown field is an error); then ApplyStageLaunchDefaults and
// ValidateStageLaunch.
absl::StatusOr<v1::StageLaunch> ParseStageLaunch(std::string_view json);
// Reads a file, then ParseStageLaunch; errors name the file.
absl::StatusOr<v1::StageLaunch> ReadStageLaunch(const std::string& path);
// The launch as one line of JSON (protobuf's mapping, the job in full).
std::string StageLaunchJson(const v1::StageLaunch& launch);
// Writes StageLaunchJson to `path` (atomically: temp file + rename).
absl::Status WriteStageLaunch(const std::string& path, const v1::StageLaunch& launch);

void ApplyStageLaunchDefaults(v1::StageLaunch* launch);
// The slot inside the job's grid, the neighbours the slot needs (unless
// they come on stdin), replicas indexed by pipeline with one DP-group
// generation, TLS with a name, non-negative limits.
absl::Status ValidateStageLaunch(const v1::StageLaunch& launch);
// The neighbours a launch with `neighbors_on_stdin` learns later: the
// patch's `next` (when this stage dials it) and `replicas` (with data
// parallelism) replace the launch's; then ValidateStageLaunch. Any other
// field set in the patch is an error.
absl::Status ApplyNeighborPatch(const v1::StageLaunch& patch, v1::StageLaunch* launch);

// A link's AQ-SGD generation: the neighbour's link_generation, 1 when 0.
uint64_t LinkGeneration(const v1::Neighbor& n);
// The DP group's generation (every replica entry carries it; 0 without).
uint64_t ReplicaGeneration(const v1::StageLaunch& launch);
absl::Duration LinkTimeout(const v1::StageLaunch& launch);
// compression.storeBytes: unset = kDefaultStoreBytes, 0 = no limit.
uint64_t StoreCapacityBytes(const v1::StageLaunch& launch);
bool IsFirstStage(const v1::StageLaunch& launch);
bool IsLastStage(const v1::StageLaunch& launch);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_LAUNCH_H_
