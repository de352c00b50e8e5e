// What a peer daemon does with an assignment from the coordinator, as pure
// functions (peer/peer_daemon.h applies them; peer/assignment_test.cc tests
// them): whether it is valid, whether the running stage child keeps
// running, is restarted or stopped, and the stage launch that runs the
// assigned place.
#ifndef AQSWARM_PEER_ASSIGNMENT_H_
#define AQSWARM_PEER_ASSIGNMENT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "proto/coordinator.pb.h"
#include "proto/job.pb.h"
#include "proto/stage.pb.h"

namespace aqswarm::peer {

// The checks an assignment from the network must pass before the daemon
// acts on it: its grid is the job's, its place is inside it, a complete
// grid names the next stage and every replica.
absl::Status ValidateAssignment(const v1::Assignment& a, const v1::JobSpec& job);

// The plan the assigned pipeline's stages run under (Assignment.run_plan,
// else plan_version): re-plans that keep the pipeline in place keep it.
uint64_t RunPlanOf(const v1::Assignment& a);

// What a stage child was started for: a new plan or place restarts it.
struct RunKey {
  uint64_t plan_version = 0;  // RunPlanOf
  uint32_t stage = 0, pipeline = 0;
  // Which side opens each link (Neighbor.reversed): a neighbour's
  // reachability may change under the same plan.
  bool accept_next = false, dial_previous = false;
  bool operator==(const RunKey& o) const {
    return plan_version == o.plan_version && stage == o.stage && pipeline == o.pipeline &&
           accept_next == o.accept_next && dial_previous == o.dial_previous;
  }
};
RunKey RunKeyOf(const v1::Assignment& a);

// What the daemon runs when an assignment comes.
struct ChildState {
  std::optional<RunKey> started_for;  // the place of the last child started (none yet)
  bool alive = false;                 // that child still runs
  bool failed = false;                // it exited with an error and no new plan came since
};

enum class AssignmentAction {
  kKeepRunning,      // the same plan and place: the child trains on
  kWaitForNextPlan,  // the child failed under this plan: wait for the coordinator's next one
  kStop,             // standby, or a grid with holes: no child
  kStart,            // stop any child, then start one for this place
};
AssignmentAction DecideAssignment(const v1::Assignment& a, const ChildState& now);

// The launch (proto/stage.proto) that runs the assigned place from
// `init_checkpoint` (empty: a fresh start at step 0). `base` holds what the
// daemon decides whatever the place (the job, listen addresses, limits,
// TLS); the slot and the neighbours come from the assignment, whole
// Neighbor messages; `self` is this peer's own replica entry (its
// GradientExchange address and name). The store and the stage's
// checkpoints live under `work_dir`.
v1::StageLaunch StageLaunchFor(const v1::Assignment& a, v1::StageLaunch base, const std::string& work_dir,
                               const v1::Neighbor& self, const std::string& init_checkpoint);

// <work_dir>/checkpoints/stage-<stage>
std::string StageCheckpointDir(const std::string& work_dir, uint32_t stage);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_ASSIGNMENT_H_
