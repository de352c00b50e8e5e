// Runs one pipeline stage as a process: owns the stage's model (StageWorker),
// its message store, the AQ-SGD link endpoints and the StageLink connections
// to its neighbours, and drives the job's schedule step by step.
//
//   AQSWARM_ASSIGN_OR_RETURN(v1::StageLaunch launch, ReadStageLaunch(path));  // stage/stage_launch.h
//   AQSWARM_ASSIGN_OR_RETURN(auto runner, StageRunner::Create(launch, report));
//   report(runner->port());          // where the previous stage must dial
//   AQSWARM_RETURN_IF_ERROR(runner->Run());
//
// Everything it runs with is the launch (proto/stage.proto). Per step it
// runs the step protocol (stage/step_protocol.h) over the links
// its handshake opened (stage/link_handshake.h), then the optimizer (with the
// data-parallel exchange when D > 1), writes the stage state every
// checkpoint_every_steps, and evaluates every eval_every_steps.
//
// Progress is reported as typed events (proto/events.proto) through
// `report`: a StepEvent per step (loss, times, CPU and rusage counters,
// bytes per link, DP bytes and parameter hash, the sender's row counts) once
// the step's state is saved, an EvalEvent per evaluation.
#ifndef AQSWARM_STAGE_STAGE_RUNNER_H_
#define AQSWARM_STAGE_STAGE_RUNNER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/events.pb.h"
#include "proto/stage.pb.h"

namespace aqswarm::stage {

class StageRunner {
 public:
  // From a launch as ReadStageLaunch / ParseStageLaunch return it (its
  // defaults applied and validated there, once: stage/stage_launch.h):
  // loads the corpus, builds the stage, opens the store and binds the
  // StageLink server (no neighbour contact yet). `report` receives the
  // progress events (may be null).
  static absl::StatusOr<std::unique_ptr<StageRunner>> Create(v1::StageLaunch launch,
                                                             std::function<void(const v1::StageEvent&)> report);
  virtual ~StageRunner() = default;
  // Bound port of the StageLink server (0 for stage 0).
  virtual int port() const = 0;
  // Bound port of the GradientExchange server (0 without data parallelism).
  virtual int exchange_port() const = 0;
  // The neighbours of a launch with neighbors_on_stdin (ApplyNeighborPatch:
  // the next stage's address, the replicas'). Before Run().
  virtual absl::Status SetNeighbors(const v1::StageLaunch& patch) = 0;
  // A replica patch while Run() trains (a launch with dp_timeline): each
  // replica of the patch (indexed by pipeline, as the launch's) whose
  // GradientExchange address or peer name changed is retargeted there.
  // Thread-safe.
  virtual absl::Status UpdateReplicas(const v1::StageLaunch& patch) = 0;
  // Connects to the neighbours and trains until the job's steps are done.
  virtual absl::Status Run() = 0;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_STAGE_RUNNER_H_
