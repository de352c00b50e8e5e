// Runs one pipeline stage as a process: owns the stage's model (StageWorker),
// its message store, the AQ-SGD link endpoints and the StageLink connections
// to its neighbours, and drives the job's schedule step by step.
//
//   StageRunnerOptions o;  o.job = job;  o.stage = 1;  o.next = "127.0.0.1:5002";
//   AQSWARM_ASSIGN_OR_RETURN(auto runner, StageRunner::Create(o));
//   report(runner->port());          // where the previous stage must dial
//   AQSWARM_RETURN_IF_ERROR(runner->Run());
//
// Per step it runs the step protocol (peer/step_protocol.h) over the links
// its handshake opened (peer/link_handshake.h), then the optimizer (with the
// data-parallel exchange when D > 1), writes the stage state every
// checkpoint_every_steps, and evaluates every eval_every_steps.
//
// Progress is reported as typed events (proto/events.proto) through
// `report`: a StepEvent per step (loss, times, CPU and rusage counters,
// bytes per link, DP bytes and parameter hash, the sender's row counts) once
// the step's state is saved, an EvalEvent per evaluation.
#ifndef AQSWARM_PEER_STAGE_RUNNER_H_
#define AQSWARM_PEER_STAGE_RUNNER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "peer/stage_checkpoints.h"  // the checkpoint_dir layout
#include "rpc/tls.h"
#include "proto/events.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

// The message store's budget when the job leaves compression.storeBytes unset.
inline constexpr uint64_t kDefaultStoreBytes = 64ull << 30;

struct StageRunnerOptions {
  v1::JobSpec job;
  int stage = 0;
  int pipeline = 0;
  // Address this stage's StageLink server binds (stages > 0, and a stage
  // with `accept_next`). Default: an ephemeral port on loopback.
  std::string listen = "127.0.0.1:0";
  // Address of stage+1 (all but the last stage): here, or through
  // SetNext() before Run() (a launcher that starts the stages in parallel
  // learns it only once stage+1 listens).
  std::string next;
  // Reversed links, for a neighbour that cannot accept connections (behind
  // NAT; peer/link_handshake.h DialPrevious): with `dial_previous` this
  // stage dials stage-1's StageLink server at `previous` instead of
  // accepting it; with `accept_next` it accepts stage+1 on `listen`
  // instead of dialing `next`. Default: neither.
  std::string previous;
  bool dial_previous = false;
  bool accept_next = false;
  // Directory of this stage's message store (aqsgd mode). Required then.
  std::string store_dir;
  // Byte budget of the message store; 0 = unlimited. Default: 0
  // (StageRunnerOptionsFor sets the job's compression.storeBytes).
  uint64_t store_capacity_bytes = 0;
  // Peer names (certificate names under mutual TLS) the assignment gives
  // stage-1 and stage+1 of this pipeline: under mTLS only `previous_peer`
  // may open the link from stage-1 and the link to stage+1 must reach
  // `next_peer`. "" = any certificate of the swarm CA. Default: "".
  std::string previous_peer;
  std::string next_peer;
  // The names of this stage's replicas, indexed by pipeline (this one's
  // entry is this peer's own): under mTLS a GradientExchange chunk from
  // rank r is taken only from the certificate named replica_peers[r].
  // Empty = any certificate of the swarm CA. Default: empty.
  std::vector<std::string> replica_peers;
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
  rpc::TlsOptions tls;
  // Receives progress events. Default: none.
  std::function<void(const v1::StageEvent&)> report;
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
