// A stage's checkpoints on disk: <dir>/state-<steps completed>.ckpt, written
// by the stage process (StageRunnerOptions::checkpoint_dir) or copied from
// another peer (the daemon's state pulls and mirror copies), and pruned to
// the newest few.
//
// Pins: the daemon names steps whose state must outlive that pruning in
// <dir>/pinned (one step per line; written atomically). It pins the step of
// its newest mirror copy of another stage, and of the copy under way: a
// re-plan can resume only at a step some live peer holds for every stage,
// and a copy that lands after its own stage's state of that step was pruned
// would be of no use.
//
// Quarantine: a state of more than the steps a new plan resumes at belongs
// to the abandoned timeline, but a report that forced that rollback may have
// been a lie; it is moved to <dir>/quarantine/state-<step>-at-<unix ms>.ckpt
// instead of deleted, and the quarantine keeps only its newest
// `max_files` states of at most `max_bytes` in all (oldest dropped first).
// Nothing reads the quarantine: an operator restores a state from it by hand.
#ifndef AQSWARM_STAGE_STAGE_CHECKPOINTS_H_
#define AQSWARM_STAGE_STAGE_CHECKPOINTS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aqswarm::stage {

std::string StageCheckpointPath(const std::string& dir, int64_t steps);
// The steps of the checkpoints present in `dir`, ascending.
std::vector<int64_t> StageCheckpointSteps(const std::string& dir);

struct QuarantineLimits {
  size_t max_files = 8;            // at least 1
  uint64_t max_bytes = 64ull << 30;  // 0: no byte bound (the newest state stays even if larger)
};

std::string StageQuarantineDir(const std::string& dir);
// The quarantined states' file names, oldest first.
std::vector<std::string> QuarantinedStates(const std::string& dir);

// Moves the checkpoints in `dir` of more than `past` steps (pinned or not:
// they belong to an abandoned timeline) into its quarantine (see the
// banner), then deletes all but the newest `keep` and the pinned ones.
// Returns how many states it quarantined.
size_t PruneStageCheckpoints(const std::string& dir, int64_t past, size_t keep, const QuarantineLimits& limits = {});

// Replaces the pins of `dir` (empty: none; steps must be >= 0).
absl::Status WriteStageCheckpointPins(const std::string& dir, const std::vector<int64_t>& steps);
// The pins of `dir`, ascending; none when there is no pins file. A malformed
// file is an error (PruneStageCheckpoints then keeps every state at or
// below `past`: it loses nothing it was asked to keep).
absl::StatusOr<std::vector<int64_t>> ReadStageCheckpointPins(const std::string& dir);

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_CHECKPOINTS_H_
