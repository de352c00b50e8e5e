// PeerDaemon's implementation, split across files by concern (as RocksDB
// splits DBImpl): peer_daemon.cc (following assignments, the stage child)
// and peer_daemon_session.cc (the coordinator session: join, heartbeats,
// the assignment watch, progress reports); of the parts it owns, its stage states (mirrors, pins, fetches, serving)
// are a StateKeeper's (peer/state_keeper.h), link measurements a
// LinkProber's (peer/link_prober.h).
// Internal to peer/: include peer/peer_daemon.h instead.
#ifndef AQSWARM_PEER_PEER_DAEMON_IMPL_H_
#define AQSWARM_PEER_PEER_DAEMON_IMPL_H_

#include "peer/peer_daemon.h"

#include <atomic>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/blas_kernels.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "peer/assignment.h"
#include "peer/coordinator_client.h"
#include "peer/link_prober.h"
#include "peer/stage_child.h"
#include "peer/state_keeper.h"
#include "peer/state_transfer.h"
#include "proto/event_json.h"
#include "proto/coordinator.pb.h"

namespace aqswarm::peer::daemon {

namespace fs = std::filesystem;

class PeerDaemonImpl final : public PeerDaemon {
 public:
  explicit PeerDaemonImpl(const PeerDaemonOptions& o) : o_(o) {}

  ~PeerDaemonImpl() override {
    Stop();
    JoinThreads();
  }

  absl::Status Init();

  int state_port() const override { return state_server_->port(); }

  void Stop() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    if (client_ != nullptr) client_->CancelWatch();
  }

  absl::Status Run() override;

 private:
  absl::Status RunInner();

  absl::Duration ReplanWait() {
    absl::MutexLock l(&mu_);
    return o_.replan_wait > absl::ZeroDuration() ? o_.replan_wait : 2 * lease_ + absl::Seconds(5);
  }

  std::pair<uint64_t, std::string> Session() {
    absl::MutexLock l(&mu_);
    return {peer_id_, session_};
  }

  void MarkRejoin() {
    absl::MutexLock l(&mu_);
    rejoin_ = true;
  }

  void Event(const v1::PeerEvent& e) {
    if (o_.report) o_.report(e);
  }
  static v1::PeerEvent JobDone() {
    v1::PeerEvent e;
    e.mutable_job_done();
    return e;
  }

  // ---- coordinator ------------------------------------------------------

  absl::Status Join();

  // Sets the request's data hashes from the job the coordinator's Status
  // names (none for synthetic data); hashes each DataSpec once.
  absl::Status AddDataIdentity(v1::JoinRequest* req);

  absl::Status LeaveQuietly();

  // The job of this work dir's last run (job.json), if any and readable.
  std::optional<v1::JobSpec> ReadPreviousJob() const;

  absl::Status WriteJob(const v1::JobSpec& job);

  void HeartbeatLoop();

  void WatchLoop();

  // With the stage states held now; no argument: the last progress again
  // (after a mirror copy landed). Returns whether the coordinator took it.
  // Reports go one at a time, so the coordinator takes them in the order
  // their held lists were read: the child's step reports and the mirror's
  // run on two threads, and a step report read before a mirror copy landed
  // would otherwise replace the copy's report and hide that state from a
  // re-plan.
  bool ReportProgress(std::optional<v1::Progress> progress = std::nullopt);
  void ReportBlame(const v1::Blame& blame);

  // ---- the child --------------------------------------------------------

  absl::Status Apply(const v1::Assignment& a, std::optional<absl::Time>* failed_at);

  // An event of the child started under `plan` (on its reader thread).
  void OnChildEvent(const v1::StageEvent& e, uint64_t plan);

  void ReapChild();

  // SIGTERM, then SIGKILL after stop_grace; always reaps.
  void StopChild();

  void JoinThreads();

  PeerDaemonOptions o_;
  std::unique_ptr<StateKeeper> keeper_;  // before the server that serves from it
  std::unique_ptr<StateTransferServer> state_server_;
  std::shared_ptr<CoordinatorClient> client_;
  std::shared_ptr<StageLauncher> launcher_;
  v1::JobSpec job_;  // from Join; read by the watch thread after Join
  std::thread heartbeat_, watch_;
  std::unique_ptr<LinkProber> prober_;  // from RunInner until Run ends
  std::unique_ptr<StageChild> child_;
  std::optional<RunKey> started_for_;  // the place of the last child started
  // The plan the child's progress is reported under: the newest assignment's
  // while the child runs on (a re-plan that kept its pipeline).
  std::atomic<uint64_t> report_plan_{0};
  std::string sent_replicas_;  // the child's replicas as last sent (a serialized patch)

  absl::Mutex report_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one ReportProgress at a time
  // (the DataSpec it was computed for, serialized; its hashes): Join's thread only.
  std::optional<std::pair<std::string, DataIdentity>> identified_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool rejoin_ ABSL_GUARDED_BY(mu_) = false;
  bool job_done_ ABSL_GUARDED_BY(mu_) = false;  // the child reported a DoneEvent
  uint64_t peer_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::string session_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);
  std::optional<v1::Assignment> latest_ ABSL_GUARDED_BY(mu_);
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<int> child_exit_ ABSL_GUARDED_BY(mu_);
  v1::Progress last_progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::peer::daemon

#endif  // AQSWARM_PEER_PEER_DAEMON_IMPL_H_
