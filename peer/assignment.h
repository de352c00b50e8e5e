// What a peer daemon does with an assignment from the coordinator, as pure
// functions (peer/peer_daemon.h applies them; peer/assignment_test.cc tests
// them): whether it is valid, whether the running stage child keeps
// running, is restarted or stopped, and the `aqswarm stage` command line
// that runs the assigned place.
#ifndef AQSWARM_PEER_ASSIGNMENT_H_
#define AQSWARM_PEER_ASSIGNMENT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "peer/stage_command.h"
#include "proto/coordinator.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

// The checks an assignment from the network must pass before the daemon
// acts on it: its grid is the job's, its place is inside it, a complete
// grid names the next stage and every replica.
absl::Status ValidateAssignment(const v1::Assignment& a, const v1::JobSpec& job);

// What a stage child was started for: a new plan or place restarts it.
struct RunKey {
  uint64_t plan_version = 0;
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

// Where and how the daemon's stage child runs (PeerDaemonOptions' fields).
struct StagePlacement {
  std::string work_dir;         // job.json, store/, checkpoints/stage-<j>
  std::string listen;           // StageLink server
  std::string exchange_listen;  // GradientExchange server
  std::string exchange_advertise;
  std::string metrics_listen;
  std::string tls_dir, tls_name;
  bool insecure = false;        // the daemon's --insecure, passed on
  int keep_checkpoints = 4;
  int link_timeout_s = 60;
  int uplink_kbps = 0;          // the daemon's --emulate_uplink_mbps, passed on
};

// The command that runs the assigned place from `init_checkpoint` (empty:
// a fresh start at step 0).
StageCommand StageCommandFor(const v1::Assignment& a, const StagePlacement& p, const std::string& init_checkpoint);

// <work_dir>/checkpoints/stage-<stage>
std::string StageCheckpointDir(const std::string& work_dir, uint32_t stage);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_ASSIGNMENT_H_
