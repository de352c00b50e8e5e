// PeerDaemon: `aqswarm peer`. Joins the coordinator, keeps its lease, follows
// its assignment and runs the assigned pipeline stage as a child process
// (`aqswarm stage`), restarting it whenever the plan changes.
//
//   PeerDaemonOptions o;
//   o.coordinator = "10.0.0.1:7000";  o.join_token = token;  o.name = "gpu-7";
//   o.listen = "0.0.0.0:7101";  o.advertise = "10.0.0.7:7101";  ...
//   AQSWARM_ASSIGN_OR_RETURN(auto daemon, PeerDaemon::Create(o));
//   std::thread t([&] { status = daemon->Run(); });
//   ... SIGTERM ...  daemon->Stop();  t.join();        // leaves the swarm
//
// How it follows the swarm (see v1::Assignment):
//   - A STAGE assignment on a complete grid starts `aqswarm stage` for
//     (stage, pipeline) at the plan's resume_step, wired to the neighbours and
//     replicas the assignment names, with their link generations.
//   - A new plan_version (someone joined a hole or left) stops the child
//     (SIGTERM, then SIGKILL after `stop_grace`) and starts it again under the
//     new plan: every placed peer restarts at the same resume_step, so peers
//     that got ahead roll back. Assignment versions that keep the plan (a
//     standby came or went) change nothing.
//   - State for the resume step: the newest `keep_checkpoints` states of the
//     stage are kept on disk (the child writes one every job
//     checkpoint_every_steps); when the step is not there (a newcomer, or a
//     peer moved to another stage) it is fetched from a peer the assignment
//     names as holding it (state_sources: replicas, mirrors), then from the
//     replicas; step 0 needs nothing (the initialisation is seeded, so
//     replicas start identical). A fetched state must have the SHA-256 its
//     holders reported (Assignment.state_sha256) and stay under a bound
//     derived from the job. A new plan first moves every state past its
//     resume step to the stage's bounded quarantine
//     (stage/stage_checkpoints.h): they belong to the abandoned timeline,
//     unless the report that forced it lied.
//   - Held states: the daemon tells the coordinator which stage states it
//     holds, with each one's SHA-256 (Join, and every progress report, one report at a time so the
//     coordinator never takes an older list after a newer one), so a re-plan
//     can resume at a step someone can serve for every stage.
//   - Mirror (Assignment.mirror, coordinator --mirror_checkpoints): after each
//     of its own checkpoints the daemon copies the mirrored peer's state of
//     the same step (the newest one, when copies fall behind) and serves it,
//     so that stage survives losing its peer. Its own state of the newest
//     copied step stays pinned (stage/stage_checkpoints.h) until a newer copy
//     lands: a slow copy is never left without its partner.
//   - Probes: heartbeat answers name peers whose link from here is unmeasured
//     or stale; a background thread times transfers to their StateTransfer
//     server (ProbeLink) and reports bandwidth and RTT (ReportLinkProbe).
//   - Standby, or a grid with holes: no child; the daemon waits.
//   - A child that fails (a neighbour vanished) is not restarted on its own:
//     the daemon waits up to `replan_wait` for the plan the coordinator
//     publishes once the lost peer's lease expires; if none comes, it rejoins,
//     which forces a re-plan.
//   - The coordinator unreachable: the child keeps training; heartbeats and
//     the assignment watch retry with backoff; a coordinator that forgot us
//     (NOT_FOUND) is joined again.
//   - A child that finishes the job (exit 0) ends Run() with OK after Leave.
//
// The StateTransfer server serves at most two fetches at once (more are
// RESOURCE_EXHAUSTED, counted in aqswarm_peer_state_transfer_refused_total),
// streaming each state from its file.
//
// Ports: the StageLink (`listen`) and GradientExchange (`exchange_listen`)
// servers live in the child and are bound again by each child, so they must
// be fixed ports; the StateTransfer server (`state_listen`) lives in the
// daemon. Every one is advertised to the coordinator as given by the
// corresponding *advertise option (default: the listen address).
//
// Progress: typed events (proto/events.proto, PeerEvent) to `report`: the
// daemon's own (joined, assignment, stage_started, child_exit, mirrored ...)
// and the child's StageEvents passed on; every step event becomes a
// ReportProgress.
//
// Thread-safety: Stop() may be called from any thread; the rest from one.
#ifndef AQSWARM_PEER_PEER_DAEMON_H_
#define AQSWARM_PEER_PEER_DAEMON_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/data_identity.h"
#include "rpc/tls.h"
#include "proto/events.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::peer {

class CoordinatorClient;
class StageLauncher;

struct PeerDaemonOptions {
  // HOST:PORT of the coordinator. Required.
  std::string coordinator;
  // From `aqswarm certs token`. Required.
  std::string join_token;
  // This peer's name (1-128 of [A-Za-z0-9._-]; the token must be for it). Required.
  std::string name;
  // StageLink server of the child: HOST:PORT with a fixed port. Required.
  std::string listen;
  std::string advertise;  // default: listen
  // GradientExchange server of the child (data parallelism): fixed port. Required.
  std::string exchange_listen;
  std::string exchange_advertise;  // default: exchange_listen
  // StateTransfer server of the daemon. Default: listen's host, any port.
  std::string state_listen;
  std::string state_advertise;  // default: state_listen with the bound port
  // Job file, message store, checkpoints and the child's log live here. Required.
  std::string work_dir;
  // Where the running stage serves its Prometheus metrics (the child's
  // --metrics_listen; a standby serves none). Default: off.
  std::string metrics_listen;
  // Mutual TLS for every connection (coordinator, child, StateTransfer).
  rpc::TlsOptions tls;
  // Allow plaintext servers on addresses other than loopback
  // (rpc::CheckListenSecurity; `aqswarm peer --insecure`). Default: refused.
  bool insecure = false;
  // The `aqswarm` binary that runs stages. Default: this executable.
  std::string executable;
  // Compute claim sent with Join (0 = unknown).
  double seconds_per_layer = 0;
  uint64_t memory_bytes = 0;
  // The child's bound on every wait for a neighbour.
  absl::Duration link_timeout = absl::Seconds(60);
  // Waits inside a step are also bounded by the link's recent waits, so a
  // neighbour that turns slow is blamed within a step (StageLaunch.
  // adaptive_link_deadline). Default: off (`--adaptive_deadline`).
  bool adaptive_link_deadline = false;
  // Newest stage states kept on disk per stage (rollback + StateTransfer). Default: 4.
  int keep_checkpoints = 4;
  // Bytes per timed probe transfer (peer/state_transfer.h). 0 = never probe.
  // Default: 1 MiB.
  size_t probe_bytes = 1 << 20;
  // Emulates a slow uplink (tests, demos): this peer's stage sends and link
  // probes go at this many Mbit/s. 0 = the real link. Default: 0.
  double emulate_uplink_mbps = 0;
  // Tells the coordinator this peer cannot accept connections
  // (JoinRequest.no_inbound; coordinator/README.md "Reachability"). Default: false.
  bool no_inbound = false;
  // How long a failed child waits for a new plan before the daemon rejoins.
  // Default: 0 = 2 x lease + 5 s.
  absl::Duration replan_wait = absl::ZeroDuration();
  // How long the coordinator may be unreachable at join (it may still be
  // starting). A coordinator that answers "later" (RESOURCE_EXHAUSTED: a
  // join rate limit or a re-plan hold; ALREADY_EXISTS: the name's old lease
  // still runs) is waited for however long it says so. Default: 60 s.
  absl::Duration join_timeout = absl::Seconds(60);
  // SIGTERM to SIGKILL for a child being stopped. Default: 10 s.
  absl::Duration stop_grace = absl::Seconds(10);
  // Receives the events (the daemon's and the child's). Default: none.
  std::function<void(const v1::PeerEvent&)> report;
  // The coordinator's client. Default: gRPC to `coordinator`
  // (peer/coordinator_client.h; tests pass a fake).
  std::shared_ptr<CoordinatorClient> coordinator_client;
  // Hashes this machine's copy of the job's data (corpus, tokenizer), which
  // the daemon reports at join; the coordinator refuses a copy that differs
  // from the swarm's. Default: pipeline/dataset.h IdentifyData (reads it
  // all once per job; tests pass a fake).
  std::function<absl::StatusOr<DataIdentity>(const v1::DataSpec&)> identify_data;
  // Starts the stage child. Default: `executable stage ...` as a process
  // logging to <work_dir>/stage.log (peer/stage_child.h; tests pass a fake).
  std::shared_ptr<StageLauncher> launcher;
};

class PeerDaemon {
 public:
  // Validates options and starts the StateTransfer server (no coordinator
  // contact yet).
  static absl::StatusOr<std::unique_ptr<PeerDaemon>> Create(const PeerDaemonOptions& options);
  virtual ~PeerDaemon() = default;
  // Joins and follows assignments until Stop() or the job is done. Errors:
  // the coordinator unreachable for `join_timeout`, the join refused (bad
  // token: UNAUTHENTICATED), the work dir unusable. A coordinator answering
  // "join later" is no error: the daemon waits.
  virtual absl::Status Run() = 0;
  // Stops the child, leaves the swarm, and makes Run() return OK. Any thread.
  virtual void Stop() = 0;
  // Bound port of the StateTransfer server.
  virtual int state_port() const = 0;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_PEER_DAEMON_H_
