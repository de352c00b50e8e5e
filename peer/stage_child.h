// The stage process a peer daemon runs, behind an interface: the real
// launcher writes the launch (proto/stage.proto) to a file, starts
// `aqswarm stage --launch FILE` as a child process and reads its events
// (proto/events.proto) on a thread; tests of the daemon launch fakes
// instead (peer/peer_daemon_test.cc).
//
//   auto launcher = ProcessStageLauncher("/usr/bin/aqswarm", "/var/lib/aqswarm");
//   AQSWARM_ASSIGN_OR_RETURN(auto child, launcher->Launch(launch, {on_event, on_exit}));
//   ...
//   child->Stop(absl::Seconds(10));   // SIGTERM, SIGKILL after the grace; returns once it is reaped
#ifndef AQSWARM_PEER_STAGE_CHILD_H_
#define AQSWARM_PEER_STAGE_CHILD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/events.pb.h"
#include "proto/stage.pb.h"

namespace aqswarm::peer {

class StageChild {
 public:
  // Kills (SIGKILL) and reaps a child that still runs.
  virtual ~StageChild() = default;
  virtual int64_t pid() const = 0;
  // SIGTERM; SIGKILL if it has not exited after `grace`. Returns once it has
  // exited and every event it printed was handed on: true when it exited
  // within the grace, false when it had to be killed.
  virtual bool Stop(absl::Duration grace) = 0;
  // Hands a running child of a launch with dp_timeline its replicas'
  // new places (StageLaunch.dp_timeline: a JSON line on its stdin).
  virtual absl::Status SendReplicas(const v1::StageLaunch& patch) {
    return absl::FailedPreconditionError("this stage child takes no replica patches");
  }
};

struct StageChildCallbacks {
  // Every event the child prints, in order (from the child's reader thread).
  std::function<void(const v1::StageEvent&)> on_event;
  // Its exit code (255 when unknown), once, after its last event.
  std::function<void(int code)> on_exit;
};

class StageLauncher {
 public:
  virtual ~StageLauncher() = default;
  virtual absl::StatusOr<std::unique_ptr<StageChild>> Launch(const v1::StageLaunch& launch,
                                                             StageChildCallbacks callbacks) = 0;
};

// Writes <work_dir>/stage-launch.json and runs `executable stage --launch`
// on it as a child process, its stderr appended to <work_dir>/stage.log. A
// line that is no event is logged and skipped.
std::unique_ptr<StageLauncher> ProcessStageLauncher(std::string executable, std::string work_dir);

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STAGE_CHILD_H_
