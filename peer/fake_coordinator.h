// An in-process CoordinatorClient for tests of the peer daemon: it admits
// every join, streams the assignments a test pushes, records what the peer
// reports, and can forget the peer (its calls then fail NOT_FOUND, as a
// coordinator that lost its lease does).
//
//   auto coordinator = std::make_shared<FakeCoordinator>(job);
//   options.coordinator_client = coordinator;
//   coordinator->Push(assignment);
//   ASSERT_TRUE(coordinator->WaitFor([](const FakeCoordinator& c) { return c.progress().size() >= 1; }));
#ifndef AQSWARM_PEER_FAKE_COORDINATOR_H_
#define AQSWARM_PEER_FAKE_COORDINATOR_H_

#include <functional>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "peer/coordinator_client.h"

namespace aqswarm::peer {

class FakeCoordinator final : public CoordinatorClient {
 public:
  explicit FakeCoordinator(v1::JobSpec job, uint64_t peer_id = 7, double lease_seconds = 1.0)
      : job_(std::move(job)), peer_id_(peer_id), lease_seconds_(lease_seconds) {}

  // ---- the test's side
  void Push(v1::Assignment a) {
    absl::MutexLock l(&mu_);
    pushed_.push_back(std::move(a));
  }
  // Joins are refused with `refusal` until `until` (a coordinator that says
  // "later": a rate limit, a re-plan hold, an old lease still running).
  void RefuseJoinsUntil(absl::Time until, absl::Status refusal) {
    absl::MutexLock l(&mu_);
    refuse_until_ = until;
    refusal_ = std::move(refusal);
  }
  // From now on the peer's calls fail NOT_FOUND until it joins again.
  void ForgetPeer() {
    absl::MutexLock l(&mu_);
    forgotten_ = true;
  }
  // Waits (bounded) until `done` holds.
  bool WaitFor(const std::function<bool(const FakeCoordinator&)>& done, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock l(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done(*this); };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }
  // Read under WaitFor's lock or after the peer stopped.
  int joins() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return joins_; }
  int refused_joins() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return refused_joins_; }
  int leaves() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return leaves_; }
  const v1::JoinRequest& last_join() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return last_join_; }
  const std::vector<v1::ProgressReport>& progress() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return progress_; }
  const std::vector<v1::BlameReport>& blames() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return blames_; }

  // ---- CoordinatorClient
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request) override {
    absl::MutexLock l(&mu_);
    if (absl::Now() < refuse_until_) {
      ++refused_joins_;
      return refusal_;
    }
    ++joins_;
    last_join_ = request;
    forgotten_ = false;
    delivered_ = 0;  // a new session's watch sees every assignment again
    v1::JoinResponse r;
    r.set_peer_id(peer_id_);
    r.set_session_token(absl::StrCat("session-", joins_));
    r.set_lease_seconds(lease_seconds_);
    *r.mutable_job() = job_;
    return r;
  }
  // What Status() answers from now on (default: the job and nothing else).
  void SetStatus(v1::StatusResponse status) {
    absl::MutexLock l(&mu_);
    status_ = std::move(status);
  }
  absl::StatusOr<v1::StatusResponse> Status() override {
    absl::MutexLock l(&mu_);
    ++status_calls_;
    if (status_.has_value()) return *status_;
    v1::StatusResponse r;
    r.set_job_name(job_.name());
    *r.mutable_job() = job_;
    return r;
  }
  int status_calls() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return status_calls_; }
  absl::Status Leave(const v1::LeaveRequest&) override {
    absl::MutexLock l(&mu_);
    ++leaves_;
    return absl::OkStatus();
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest&, absl::Duration) override {
    absl::MutexLock l(&mu_);
    if (forgotten_) return absl::NotFoundError("no such peer");
    return v1::HeartbeatResponse();
  }
  absl::Status ReportProgress(const v1::ProgressReport& request) override {
    absl::MutexLock l(&mu_);
    if (forgotten_) return absl::NotFoundError("no such peer");
    progress_.push_back(request);
    return absl::OkStatus();
  }
  absl::Status ReportLinkProbe(const v1::LinkProbeReport&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::BlameResponse> ReportBlame(const v1::BlameReport& request) override {
    absl::MutexLock l(&mu_);
    blames_.push_back(request);
    v1::BlameResponse r;
    r.set_outcome(v1::BlameResponse::RECORDED);
    return r;
  }
  absl::Status WatchAssignment(const v1::WatchAssignmentRequest&,
                               const std::function<void(const v1::Assignment&)>& on_assignment) override {
    while (true) {
      std::vector<v1::Assignment> batch;
      {
        absl::MutexLock l(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return cancelled_ || forgotten_ || delivered_ < pushed_.size();
        };
        mu_.Await(absl::Condition(&ready));
        if (cancelled_) return absl::CancelledError("the assignment watch was cancelled");
        if (forgotten_) return absl::NotFoundError("no such peer");
        batch.assign(pushed_.begin() + delivered_, pushed_.end());
        delivered_ = pushed_.size();
      }
      for (const v1::Assignment& a : batch) on_assignment(a);
    }
  }
  void CancelWatch() override {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
  }

 private:
  const v1::JobSpec job_;
  const uint64_t peer_id_;
  const double lease_seconds_;
  mutable absl::Mutex mu_;
  std::vector<v1::Assignment> pushed_ ABSL_GUARDED_BY(mu_);
  size_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool forgotten_ ABSL_GUARDED_BY(mu_) = false;
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time refuse_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Status refusal_ ABSL_GUARDED_BY(mu_);
  int refused_joins_ ABSL_GUARDED_BY(mu_) = 0;
  int status_calls_ ABSL_GUARDED_BY(mu_) = 0;
  v1::JoinRequest last_join_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::StatusResponse> status_ ABSL_GUARDED_BY(mu_);
  int leaves_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::ProgressReport> progress_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::BlameReport> blames_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_FAKE_COORDINATOR_H_
