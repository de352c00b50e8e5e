// Runs one pipeline stage as a process: owns the stage's model (StageWorker),
// its message store, the AQ-SGD link endpoints and the StageLink connections
// to its neighbours, and drives the job's schedule step by step.
//
//   StageRunnerOptions o;  o.job = job;  o.stage = 1;  o.next = "127.0.0.1:5002";
//   AQSWARM_ASSIGN_OR_RETURN(auto runner, StageRunner::Create(o));
//   report(runner->port());          // where the previous stage must dial
//   AQSWARM_RETURN_IF_ERROR(runner->Run());
//
// Per step (M micro-batches): forwards and backwards in the order of
// job.schedule (pipeline/step_schedule.h: adaptive runs whichever has its
// input first, 1f1b interleaves them in a fixed order, gpipe runs all
// forwards first; backwards always in increasing micro-batch order),
// sending each stage output downstream and each input gradient upstream as
// soon as it is computed (each link direction has its own writer thread, so
// transfers overlap compute and each other). The last backward (micro-batch
// M-1) carries the sum of squared gradient norms of the
// stages below; stage 0 completes the sum and sends a StepCommit down the
// pipeline, so every stage clips by the whole model's gradient norm and steps
// in lockstep. Every wait on a neighbour is bounded by `link_timeout`; a
// vanished neighbour turns into an error naming the link.
//
// Progress is reported as one JSON object per line through `report`:
//   {"event":"step","stage":0,"step":3,"epoch":0,"loss":...,"step_seconds":...,
//    "compute_seconds":...,"wait_seconds":...,"cpu_seconds":...,"sys_seconds":...,"minor_faults":...,
//    "ctx_switches":...,"invol_ctx_switches":...,"fw_bytes":...,"bw_bytes":...,...}
//   (cpu_seconds: the process's CPU time over the step, all threads, sys_seconds
//   its kernel part; faults and context switches (voluntary, involuntary) over
//   the step, from getrusage)
//   {"event":"eval","stage":0,"step":3,"val_loss":...}
#ifndef AQSWARM_PEER_STAGE_RUNNER_H_
#define AQSWARM_PEER_STAGE_RUNNER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "peer/stage_checkpoints.h"  // the checkpoint_dir layout
#include "peer/tls.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

struct StageRunnerOptions {
  v1::JobSpec job;
  int stage = 0;
  int pipeline = 0;
  // Address this stage's StageLink server binds (stages > 0). Default: an
  // ephemeral port on loopback.
  std::string listen = "127.0.0.1:0";
  // Address of stage+1 (all but the last stage): here, or through
  // SetNext() before Run() (a launcher that starts the stages in parallel
  // learns it only once stage+1 listens).
  std::string next;
  // Directory of this stage's message store (aqsgd mode). Required then.
  std::string store_dir;
  // Byte budget of the message store; 0 = unlimited. Default: 0.
  uint64_t store_capacity_bytes = 0;
  // AQ-SGD link generation; both ends of a link must agree. Default: 1.
  uint64_t generation = 1;
  // Generations of the link to stage+1 and from stage-1 when they differ
  // (a swarm renews only the links that lost a peer). 0 = `generation`.
  uint64_t next_generation = 0;
  uint64_t previous_generation = 0;
  // Address the GradientExchange server binds (D > 1). Default: the host of
  // `listen`, any port.
  std::string exchange_listen;
  // Generation of the stage's data-parallel group: chunks of other
  // generations are refused. Default: 0.
  uint64_t replica_generation = 0;
  // Swarm plan version this run belongs to (v1::Assignment::plan_version).
  // Neighbours of an older plan are stale incarnations: StageLink dialers
  // retry past them, GradientExchange chunks are refused by them and retried
  // (see DialNext/AcceptPrevious). Default: 0 (no swarm).
  uint64_t plan = 0;
  // Steps completed before this run: training starts at this global step
  // (its epoch and position follow from the sample plan). Default: 0.
  int64_t start_step = 0;
  // Stage state (pipeline/stage_io.h checkpoint) to load first; it must hold
  // `start_step` completed steps. Default: none (fresh, seeded initialisation).
  std::string init_checkpoint;
  // When set, the state after `start_step` and after every step whose
  // count is a multiple of the job's checkpoint_every_steps is written here
  // as state-<steps completed>.ckpt (atomically: temp file + rename) and only
  // the newest `keep_checkpoints` files (and those pinned,
  // peer/stage_checkpoints.h) are kept: what a rollback or a joining replica
  // (StateTransfer) needs. Default: none.
  std::string checkpoint_dir;
  int keep_checkpoints = 4;
  // Bound on every wait for a neighbour. Default: 120 s.
  absl::Duration link_timeout = absl::Seconds(120);
  // Mutual TLS for every connection of this stage (StageLink both ways,
  // GradientExchange). Default: plaintext.
  TlsOptions tls;
  // Receives progress lines (JSON). Default: none.
  std::function<void(const std::string&)> report;
};


class StageRunner {
 public:
  // Validates options, loads the corpus, builds the stage, opens the store
  // and binds the StageLink server (no neighbour contact yet).
  static absl::StatusOr<std::unique_ptr<StageRunner>> Create(const StageRunnerOptions& options);
  virtual ~StageRunner() = default;
  // Bound port of the StageLink server (0 for stage 0).
  virtual int port() const = 0;
  // Bound port of the GradientExchange server (0 without data parallelism).
  virtual int exchange_port() const = 0;
  // The address of stage+1, when `options.next` was empty. Before Run().
  virtual absl::Status SetNext(const std::string& address) = 0;
  // Data parallelism: the GradientExchange addresses of this stage's
  // replicas, indexed by pipeline. Required before Run() when D > 1.
  virtual absl::Status SetReplicas(const std::vector<std::string>& addresses) = 0;
  // Connects to the neighbours and trains until the job's steps are done.
  virtual absl::Status Run() = 0;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STAGE_RUNNER_H_
