#include "peer/peer_daemon_impl.h"
#include "pipeline/job_spec.h"

namespace aqswarm::peer::daemon {
namespace {

// <work dir>/session: the session token of this work dir's last join.
std::string SavedSessionPath(const std::string& work_dir) { return (fs::path(work_dir) / "session").string(); }

std::string ReadSavedSession(const std::string& work_dir) {
  std::ifstream in(SavedSessionPath(work_dir));
  std::string token;
  if (!in || !std::getline(in, token) || token.size() > 256) return "";
  return token;
}

}  // namespace

absl::Status PeerDaemonImpl::Join() {
  // Bounds how long the coordinator may stay unreachable. One that answers
  // "later" (a join rate limit, a re-plan hold of up to minutes, a name whose
  // old lease has yet to run out) is reachable: each such answer restarts it.
  absl::Time deadline = absl::Now() + o_.join_timeout;
  absl::Duration backoff = absl::Milliseconds(200);
  std::string waiting_for;  // the last "later" answer, logged once
  v1::JoinRequest req;
  req.set_peer_name(o_.name);
  req.set_join_token(o_.join_token);
  req.set_stage_link_address(o_.advertise);
  req.set_gradient_exchange_address(o_.exchange_advertise);
  req.set_state_transfer_address(o_.state_advertise);
  req.set_seconds_per_layer(o_.seconds_per_layer);
  req.set_memory_bytes(o_.memory_bytes);
  req.set_no_inbound(o_.no_inbound);
  // States on disk from an earlier run count for that run's job only.
  const std::optional<v1::JobSpec> previous = ReadPreviousJob();
  if (previous.has_value()) {
    req.set_held_job_name(previous->name());
    for (v1::StageCheckpoints& h : keeper_->Held()) *req.add_held() = std::move(h);
  }
  while (true) {
    {
      // A rejoin proves it is this name's member again with the last
      // session: this process's, or after a restart the one it saved.
      absl::MutexLock l(&mu_);
      req.set_previous_session_token(session_.empty() ? ReadSavedSession(o_.work_dir) : session_);
    }
    const absl::Status identified = AddDataIdentity(&req);
    absl::StatusOr<v1::JoinResponse> joined = identified.ok() ? client_->Join(req) : identified;
    absl::Status s = joined.status();
    if (s.ok()) {
      const v1::JoinResponse& resp = *joined;
      if (previous.has_value() && !google::protobuf::util::MessageDifferencer::Equals(*previous, resp.job())) {
        // Another job (or the same name with other settings): its states must not be served.
        AQSWARM_RETURN_IF_ERROR(RemoveTree(keeper_->root()));
        v1::PeerEvent e;
        e.mutable_stale_states_removed()->set_reason("the work dir held states of another job");
        Event(e);
      }
      AQSWARM_RETURN_IF_ERROR(WriteJob(resp.job()));
      // Kept (0600) so that a restarted daemon proves it is this member again.
      if (absl::Status saved = WriteFileAtomically(SavedSessionPath(o_.work_dir), resp.session_token(), 0600); !saved.ok()) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": cannot save the session token: " << saved;
      }
      absl::MutexLock l(&mu_);
      peer_id_ = resp.peer_id();
      session_ = resp.session_token();
      lease_ = absl::Seconds(std::max(0.5, resp.lease_seconds()));
      rejoin_ = false;
      latest_.reset();
      applied_ = 0;
      v1::PeerEvent e;
      e.mutable_joined()->set_peer_id(peer_id_);
      e.mutable_joined()->set_lease_s(resp.lease_seconds());
      e.mutable_joined()->set_state_port(state_server_->port());
      Event(e);
      return absl::OkStatus();
    }
    // Refusals are final; an unreachable coordinator is retried until the
    // join timeout, one that says "later" for as long as it says so.
    const bool later = absl::IsResourceExhausted(s) || absl::IsAlreadyExists(s);
    if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s) && !later) return s;
    if (later) {
      if (s.message() != waiting_for) {
        waiting_for = std::string(s.message());
        AQSWARM_LOG(INFO) << "peer " << o_.name << ": the coordinator says join later: " << waiting_for;
      }
    } else if (absl::Now() + backoff > deadline) {
      return absl::UnavailableError(absl::StrCat("coordinator ", o_.coordinator, " unreachable for ",
                                                 absl::FormatDuration(o_.join_timeout), ": ", s.message()));
    }
    absl::MutexLock l(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff)) return absl::CancelledError("stopped");
    if (later) deadline = absl::Now() + o_.join_timeout;
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

absl::Status PeerDaemonImpl::AddDataIdentity(v1::JoinRequest* req) {
  AQSWARM_ASSIGN_OR_RETURN(const v1::StatusResponse status, client_->Status());
  req->clear_dataset_hash();
  req->clear_tokenizer_hash();
  v1::DataSpec data = status.job().data();
  if (data.synthetic_tokens() > 0) return absl::OkStatus();
  data.clear_dataset_hash();
  data.clear_tokenizer_hash();
  const std::string key = data.SerializeAsString();
  if (!identified_.has_value() || identified_->first != key) {
    absl::StatusOr<DataIdentity> id = o_.identify_data(data);
    if (!id.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot read this machine's copy of the job's data (data.corpus '", data.corpus(),
                       "', data.tokenizer '", data.tokenizer(), "'): ", id.status().message()));
    }
    identified_.emplace(key, *id);
  }
  req->set_dataset_hash(identified_->second.dataset_hash);
  req->set_tokenizer_hash(identified_->second.tokenizer_hash);
  return absl::OkStatus();
}

absl::Status PeerDaemonImpl::LeaveQuietly() {
  v1::LeaveRequest req;
  const auto [id, session] = Session();
  req.set_peer_id(id);
  req.set_session_token(session);
  return client_->Leave(req);
}

// The job of this work dir's last run (job.json), if any and readable.
std::optional<v1::JobSpec> PeerDaemonImpl::ReadPreviousJob() const {
  std::ifstream in(fs::path(o_.work_dir) / "job.json");
  if (!in) return std::nullopt;
  std::stringstream buf;
  buf << in.rdbuf();
  // As written (an older build's job.json too: its "" choices, "1f1b").
  absl::StatusOr<v1::JobSpec> job = pipeline::ReadJobSpecJson(buf.str());
  if (!job.ok()) return std::nullopt;
  return *std::move(job);
}

absl::Status PeerDaemonImpl::WriteJob(const v1::JobSpec& job) {
  if (job_.name().empty()) {  // set before the threads start; the job never changes
    job_ = job;
    keeper_->SetJob(job.name());
  }
  return WriteFileAtomically((fs::path(o_.work_dir) / "job.json").string(), pipeline::JobSpecJson(job) + "\n", 0644);
}

void PeerDaemonImpl::HeartbeatLoop() {
  while (true) {
    v1::HeartbeatRequest req;
    absl::Duration period;
    {
      absl::MutexLock l(&mu_);
      period = lease_ / 3;
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
      if (rejoin_) continue;
      req.set_peer_id(peer_id_);
      req.set_session_token(session_);
    }
    absl::StatusOr<v1::HeartbeatResponse> resp = client_->Heartbeat(req, period);
    if (resp.ok()) prober_->Enqueue(resp->probe());
    if ((absl::IsNotFound(resp.status()) || absl::IsUnauthenticated(resp.status())) &&
        Session().second == req.session_token()) {
      AQSWARM_LOG(WARNING) << "peer " << o_.name << ": the coordinator no longer knows us (" << resp.status().message()
                           << "); joining again";
      MarkRejoin();
    }
  }
}

void PeerDaemonImpl::WatchLoop() {
  absl::Duration backoff = absl::Milliseconds(200);
  while (true) {
    v1::WatchAssignmentRequest req;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](PeerDaemonImpl* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->stop_ || !d->rejoin_; },
          this));
      if (stop_) return;
      req.set_peer_id(peer_id_);
      req.set_session_token(session_);
    }
    const absl::Status s = client_->WatchAssignment(req, [&](const v1::Assignment& a) {
      backoff = absl::Milliseconds(200);
      absl::Status v = ValidateAssignment(a, job_);
      absl::MutexLock l(&mu_);
      if (!v.ok()) {
        AQSWARM_LOG(WARNING) << "peer " << o_.name << ": ignoring assignment v" << a.version() << ": " << v;
        return;
      }
      if (a.peer_id() == peer_id_ && (!latest_.has_value() || a.version() > latest_->version())) latest_ = a;
    });
    absl::MutexLock l(&mu_);
    if (stop_ || absl::IsCancelled(s)) return;
    if (absl::IsNotFound(s) || absl::IsUnauthenticated(s)) {
      if (session_ == req.session_token()) rejoin_ = true;  // else we already joined again
      continue;
    }
    mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

// With the stage states held now; no argument: the last progress again
// (after a mirror copy landed). Returns whether the coordinator took it.
// Reports go one at a time, so the coordinator takes them in the order
// their held lists were read: the child's step reports and the mirror's
// run on two threads, and a step report read before a mirror copy landed
// would otherwise replace the copy's report and hide that state from a
// re-plan.
bool PeerDaemonImpl::ReportProgress(std::optional<v1::Progress> progress) {
  absl::MutexLock serial(&report_mu_);
  v1::ProgressReport req;
  {
    absl::MutexLock l(&mu_);
    if (progress.has_value()) last_progress_ = *progress;
    req.set_peer_id(peer_id_);
    req.set_session_token(session_);
    *req.mutable_progress() = last_progress_;
  }
  req.set_has_held(true);
  for (v1::StageCheckpoints& h : keeper_->Held()) *req.add_held() = std::move(h);
  const absl::Status s = client_->ReportProgress(req);
  if (!s.ok()) {
    AQSWARM_LOG(DEBUG) << "progress report failed: " << s;
  }
  return s.ok();
}

}  // namespace aqswarm::peer::daemon
